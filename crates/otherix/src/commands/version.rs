//! `otherix version`: this client's version, and the control plane's when
//! it can be asked (kubectl's `version`).

use std::time::Duration;

use otherix_client::Client;
use serde::Serialize;

use super::Ctx;
use crate::cli::Format;
use crate::error;
use crate::output;

/// How long the server may take to say its version.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Serialize)]
struct Versions {
    client: ClientVersion,
    /// Absent when there is no config or the server did not answer.
    server: Option<ServerVersion>,
}

#[derive(Debug, Serialize)]
struct ClientVersion {
    version: &'static str,
}

#[derive(Debug, Serialize)]
struct ServerVersion {
    version: String,
    cluster_id: String,
    url: String,
}

pub async fn run(ctx: &Ctx) -> anyhow::Result<()> {
    let server = match ask_server(ctx).await {
        Ok(s) => Some(s),
        Err(e) => {
            // Not a failure: the client's version is what was certainly asked.
            eprintln!("note: no server version: {}", error::message(&e));
            None
        }
    };
    let versions = Versions {
        client: ClientVersion {
            version: env!("CARGO_PKG_VERSION"),
        },
        server,
    };
    match ctx.format {
        Format::Json | Format::Yaml => output::data(ctx.format, &versions),
        Format::Table | Format::Wide => {
            let mut rows = vec![("Client Version", versions.client.version.to_string())];
            if let Some(s) = &versions.server {
                rows.push(("Server Version", s.version.clone()));
                rows.push(("Server", s.url.clone()));
                rows.push(("Cluster ID", s.cluster_id.clone()));
            }
            output::fields(&rows);
            Ok(())
        }
    }
}

/// `GET /v1/info` of the logged-in server: needs the config (for the
/// address and the CA to trust), not a token.
async fn ask_server(ctx: &Ctx) -> anyhow::Result<ServerVersion> {
    let (_, context) = ctx.context()?;
    let client = Client::new(context.server.urls(), &context.ca_pem, None)?;
    let info = tokio::time::timeout(ASK_TIMEOUT, client.info())
        .await
        .map_err(|_| anyhow::anyhow!("{} did not answer within {ASK_TIMEOUT:?}", context.server))??;
    Ok(ServerVersion {
        version: info.version,
        cluster_id: info.cluster_id,
        url: client.server().to_string(),
    })
}
