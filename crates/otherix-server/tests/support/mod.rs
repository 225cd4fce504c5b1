//! What the router's suites share (`mod support;` in each): a control
//! plane's state and router over a real store in a data directory of its
//! own, and an HTTP answer read off a real socket.

// Each suite uses a part.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use otherix_proto::ServerInfo;
use otherix_server::state::{AppState, Settings};

/// A data directory of its own, removed on drop.
pub struct Dir(pub PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A control plane as `otherix server` builds it, without its listeners.
pub struct Server {
    pub router: Router,
    pub state: AppState,
    /// The first admin's token (`admin.token`).
    pub admin: String,
    pub dir: Dir,
}

impl Server {
    /// A fresh one; `suite` names its data directory
    /// (`$TMPDIR/otherix-SUITE-PID-RANDOM`).
    pub async fn start(suite: &str) -> Server {
        let dir = Dir(std::env::temp_dir().join(format!(
            "otherix-{suite}-{}-{}",
            std::process::id(),
            hex::encode(otherix_server::random::bytes::<6>())
        )));
        let opened = otherix_server::open(&dir.0, None, None).await.unwrap();
        let info = Arc::new(ServerInfo {
            cluster_id: opened.cluster_id.clone(),
            version: "test".into(),
            ca_fingerprint: opened.ca.fingerprint(),
        });
        let state = otherix_server::app_state(opened, info, Settings::default())
            .await
            .unwrap();
        let admin = std::fs::read_to_string(dir.0.join("admin.token"))
            .unwrap()
            .trim()
            .to_string();
        Server {
            router: otherix_server::api::router(state.clone()),
            state,
            admin,
            dir,
        }
    }
}

/// Sends `request` (a whole HTTP/1.1 request) on a new connection to `addr`
/// and reads the answer, which must carry a `Content-Length` (a refused
/// upgrade does): its status, head and body.
pub async fn answer(addr: std::net::SocketAddr, request: &str) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    loop {
        let mut buf = [0u8; 4096];
        let n = conn.read(&mut buf).await.unwrap();
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .expect("an answer with a length");
            if body.len() >= len || n == 0 {
                let status = head.split(' ').nth(1).unwrap().parse().unwrap();
                return (status, head.to_string(), body.to_string());
            }
        }
        assert!(n > 0, "the connection ended before an answer: {text}");
    }
}
