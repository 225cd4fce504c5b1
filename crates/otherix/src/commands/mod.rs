//! One module per noun; each verb is a function in it.

mod agent;
mod audit;
mod completion;
pub(crate) mod connect;
mod console;
mod context;
#[cfg(feature = "dev")]
mod dev;
mod grant;
mod guest;
mod image;
mod keys;
mod lb;
mod login;
mod network;
mod node;
mod server;
mod session;
mod user;
mod version;
mod vm;
mod watch;

use std::path::PathBuf;

use anyhow::Context as _;
use otherix_client::Client;

use crate::cli::{Cli, Command, Format};
use crate::{config, env};

/// What every command needs from the global flags.
#[derive(Debug)]
pub struct Ctx {
    pub format: Format,
    pub config_path: Option<PathBuf>,
    /// `--context` / `OTHERIX_CONTEXT`: the context to use instead of the current one.
    pub context: Option<String>,
    pub grant_file: Option<PathBuf>,
}

impl Ctx {
    pub fn config_path(&self) -> anyhow::Result<PathBuf> {
        config::path(self.config_path.as_deref())
    }

    /// A grant token from `--grant-file` or `OTHERIX_GRANT`, if any.
    pub fn grant(&self) -> anyhow::Result<Option<String>> {
        if let Some(file) = self.grant_file()? {
            return Ok(Some(match file {
                Ok(whole) => whole.token,
                Err(token) => token,
            }));
        }
        Ok(std::env::var(env::GRANT)
            .ok()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty()))
    }

    /// `--grant-file`, read: the whole grant (servers, CA, token) or only
    /// its token.
    pub fn grant_file(&self) -> anyhow::Result<Option<Result<config::GrantFile, String>>> {
        let Some(path) = &self.grant_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading grant file {}", path.display()))?;
        config::GrantFile::parse(&text)
            .with_context(|| format!("reading grant file {}", path.display()))
            .map(Some)
    }

    /// The context this command uses (`--context`, else the current one)
    /// and its name.
    pub fn context(&self) -> anyhow::Result<(String, config::Context)> {
        let path = self.config_path()?;
        let file = config::load_existing(&path)?;
        let (name, context) = file.select(self.context.as_deref(), &path)?;
        Ok((name.to_string(), context.clone()))
    }

    /// A client of the context's control plane. A grant (`--grant-file`,
    /// `OTHERIX_GRANT`) wins over `OTHERIX_TOKEN`, which wins over the
    /// context's token.
    pub fn client(&self) -> anyhow::Result<Client> {
        let (name, context) = self.context()?;
        let env_token = std::env::var(env::TOKEN)
            .ok()
            .filter(|t| !t.trim().is_empty())
            .map(|t| t.trim().to_string());
        let Some(token) = self.grant()?.or(env_token).or(context.token) else {
            anyhow::bail!(
                "not logged in to context {name:?}: its token was removed (`otherix logout`)\nhint: run `otherix login --name {name} --server {} --token-file FILE`",
                context.server.urls().first().map_or("URL", String::as_str)
            );
        };
        Client::new(context.server.urls(), &context.ca_pem, Some(token))
            .with_context(|| format!("using context {name:?}"))
    }
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let ctx = Ctx {
        format: cli.output,
        config_path: cli.config,
        context: cli.context,
        grant_file: cli.grant_file,
    };
    match cli.command {
        Command::Server(args) => server::run(args).await,
        Command::Login(args) => login::run(&ctx, args).await,
        Command::Whoami => login::whoami(&ctx).await,
        Command::Logout => login::logout(&ctx),
        Command::Context(cmd) => context::run(&ctx, cmd),
        Command::Version => version::run(&ctx).await,
        Command::User(cmd) => user::run(&ctx, cmd).await,
        Command::Network(cmd) => network::run(&ctx, cmd).await,
        Command::Vm(cmd) => vm::run(&ctx, cmd).await,
        Command::Image(cmd) => image::run(ctx.format, cmd).await,
        Command::Agent(args) => agent::run(args).await,
        Command::Connect { target, port } => connect::connect(&ctx, &target, port).await,
        Command::Console { vm } => console::console(&ctx, &vm).await,
        Command::Forward {
            target,
            ports,
            address,
            local,
            ready,
            ready_keep,
        } => {
            let listen = connect::listen_addrs(&ports, address, local)?;
            connect::forward(
                &ctx,
                &target,
                &listen,
                connect::Readiness::new(&target, ready, ready_keep)?,
            )
            .await
        }
        Command::Ssh {
            destination,
            port,
            ssh_args,
        } => connect::ssh(&ctx, &destination, port, &ssh_args),
        Command::SshConfig => connect::ssh_config(&ctx),
        #[cfg(feature = "dev")]
        Command::Dev(args) => dev::run(&ctx, args).await,
        Command::Node(cmd) => node::run(&ctx, cmd).await,
        Command::Guest(cmd) => guest::run(cmd).await,
        Command::Lb(cmd) => lb::run(&ctx, cmd).await,
        Command::Grant(cmd) => grant::run(&ctx, cmd).await,
        Command::Audit(args) => audit::run(&ctx, args).await,
        Command::Session(cmd) => session::run(&ctx, cmd).await,
        Command::Keys(cmd) => keys::run(&ctx, cmd).await,
        Command::Completion { shell } => completion::run(shell),
    }
}
