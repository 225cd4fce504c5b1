//! How the long-running commands (`server`, `agent`, `dev`, `forward`) learn
//! they should stop: the first SIGINT or SIGTERM.

use tokio::signal::unix::{signal, SignalKind};

/// Resolves on the first SIGINT or SIGTERM.
pub async fn shutdown() {
    let (Ok(mut int), Ok(mut term)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate()))
    else {
        // Without signal handlers, run until killed.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => {},
        _ = term.recv() => {},
    }
    tracing::info!("shutdown requested");
    eprintln!("shutting down...");
}
