//! What an operator scrapes and probes on every Otherix daemon, on a listen
//! address of its own (`--metrics-listen`), never the public port:
//!
//! - `GET /metrics`: Prometheus text, from the process-wide `metrics`
//!   recorder ([`install`]); every crate records with the `metrics` macros.
//! - `GET /healthz`: the process answers (200 `ok`).
//! - `GET /readyz`: the daemon can do its work (200 `ready`, or 503 and the
//!   reason in one line), as its [`Probe`] says.
//!
//! Plain HTTP/1.1: what a Prometheus server and a kubelet speak; bind it to
//! a management address. Anything else is 404; only GET and HEAD are served.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;

/// Buckets of every latency histogram (seconds): 100 µs to 10 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Buckets of session durations (seconds): 1 s to 1 day.
const SESSION_BUCKETS: &[f64] = &[
    1.0,
    10.0,
    60.0,
    300.0,
    1800.0,
    3600.0,
    4.0 * 3600.0,
    12.0 * 3600.0,
    86_400.0,
];

/// A slow scraper gets this long for its request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Installs the process-wide recorder (once; later calls return the same
/// handle). Histograms named `*_duration_seconds` get latency buckets,
/// `*_session_duration_seconds` session buckets.
pub fn install() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Suffix("session_duration_seconds".into()),
                    SESSION_BUCKETS,
                )
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
                        LATENCY_BUCKETS,
                    )
                });
            let recorder = match builder {
                Ok(b) => b.build_recorder(),
                // Only an empty bucket list fails; ours are constants.
                Err(_) => PrometheusBuilder::new().build_recorder(),
            };
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics shows only ours");
            }
            let upkeep = handle.clone();
            // Histograms are summarized lazily; keep them from growing
            // between scrapes.
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || loop {
                    std::thread::sleep(Duration::from_secs(5));
                    upkeep.run_upkeep();
                })
                .ok();
            handle
        })
        .clone()
}

/// Why a daemon is not ready: its own error type, shown as `/readyz`'s body.
pub type NotReady = Box<dyn std::error::Error + Send + Sync>;

/// What a daemon says about itself at scrape and probe time.
pub trait Probe: Send + Sync + 'static {
    /// `Ok` when the daemon can do its work; `Err` with the reason otherwise.
    fn ready(&self) -> BoxFuture<'_, Result<(), NotReady>>;
    /// Refreshes gauges read from state (nodes by status, open sessions...)
    /// just before a scrape renders them.
    fn refresh(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until
/// `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    probe: Arc<dyn Probe>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let handle = install();
    let local = listener.local_addr().ok();
    tracing::info!(addr = ?local, "metrics and health endpoints listening");
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(x) => x,
                Err(e) => {
                    tracing::debug!(error = %e, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let handle = handle.clone();
        let probe = probe.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| answer(req, handle.clone(), probe.clone()));
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(tcp), service);
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "metrics connection ended with an error");
            }
        });
    }
}

/// Binds `addr` and serves there on a task of its own; returns the bound
/// address. The task ends with the process.
pub async fn spawn(addr: SocketAddr, probe: Arc<dyn Probe>) -> std::io::Result<SocketAddr> {
    install();
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(serve(listener, probe, std::future::pending()));
    Ok(local)
}

async fn answer(
    req: Request<Incoming>,
    handle: PrometheusHandle,
    probe: Arc<dyn Probe>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return Ok(text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n"));
    }
    Ok(match req.uri().path() {
        "/metrics" => {
            probe.refresh().await;
            let mut r = text(StatusCode::OK, &handle.render());
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" => match probe.ready().await {
            Ok(()) => text(StatusCode::OK, "ready\n"),
            Err(reason) => text(StatusCode::SERVICE_UNAVAILABLE, &format!("not ready: {reason}\n")),
        },
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /metrics, /healthz or /readyz\n",
        ),
    })
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_owned())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    struct Flag(AtomicBool);

    impl Probe for Flag {
        fn ready(&self) -> BoxFuture<'_, Result<(), NotReady>> {
            Box::pin(async {
                if self.0.load(Ordering::SeqCst) {
                    Ok(())
                } else {
                    Err("store unreachable".into())
                }
            })
        }
        fn refresh(&self) -> BoxFuture<'_, ()> {
            Box::pin(async { metrics::gauge!("otherix_test_refreshed").set(1.0) })
        }
    }

    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        let status = out[9..12].parse().unwrap();
        (
            status,
            out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string(),
        )
    }

    #[tokio::test]
    async fn metrics_health_and_readiness_are_served() {
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let addr = spawn("127.0.0.1:0".parse().unwrap(), flag.clone()).await.unwrap();
        metrics::counter!("otherix_test_total", "outcome" => "x").increment(3);
        metrics::histogram!("otherix_test_duration_seconds").record(0.002);
        assert_eq!(get(addr, "/healthz").await, (200, "ok\n".into()));
        let (status, body) = get(addr, "/readyz").await;
        assert_eq!((status, body.as_str()), (503, "not ready: store unreachable\n"));
        flag.0.store(true, Ordering::SeqCst);
        assert_eq!(get(addr, "/readyz").await.0, 200);
        let (status, body) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        assert!(body.contains("otherix_test_total{outcome=\"x\"} 3"), "{body}");
        assert!(
            body.contains("otherix_test_duration_seconds_bucket{le=\"0.0025\"} 1"),
            "{body}"
        );
        assert!(
            body.contains("otherix_test_refreshed 1"),
            "refreshed before the scrape: {body}"
        );
        assert_eq!(get(addr, "/v1/info").await.0, 404);
    }
}
