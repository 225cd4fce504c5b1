//! Credentials per second: many concurrent `POST /v1/broker` calls through
//! the typed client, for a fixed time, counting the answers that carry a
//! credential. Each call is what a client does per connection: a new TLS
//! connection to the control plane, one request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use otherix_proto::{BrokerRequest, BrokerResponse};

use otherix_client::{Client, ClientError};

use crate::bed::{Bed, VM};
use crate::options::Options;
use crate::procfs;

#[derive(Debug, Clone)]
pub struct BrokerRate {
    pub credentials: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub elapsed: Duration,
    pub concurrency: usize,
    /// Control-plane CPU seconds per credential.
    pub cp_cpu_per_credential: f64,
}

impl BrokerRate {
    pub fn per_second(&self) -> f64 {
        self.credentials as f64 / self.elapsed.as_secs_f64()
    }
}

/// One broker call for the bench VM's `port`.
pub async fn broker_once(client: &Client, port: u16) -> Result<BrokerResponse, ClientError> {
    broker_for(client, VM, port).await
}

/// One broker call for `vm`'s `port`.
pub async fn broker_for(client: &Client, vm: &str, port: u16) -> Result<BrokerResponse, ClientError> {
    client
        .broker(&BrokerRequest {
            target: vm.into(),
            port: port.into(),
            exclude: Vec::new(),
        })
        .await
}

/// `opts.broker_concurrency` callers, each brokering in a loop until
/// `opts.broker_time` has passed (calls in flight then are still counted).
pub async fn rate(bed: &Bed, opts: &Options) -> anyhow::Result<BrokerRate> {
    // Warm up: the first calls pay for lazy initialisation on both sides.
    for _ in 0..20 {
        broker_once(&bed.client, crate::bed::ECHO_PORT).await?;
    }
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let first_error = Arc::new(std::sync::Mutex::new(None));
    let cpu_before = procfs::cpu_seconds(bed.cp_pid, false)?;
    let started = Instant::now();
    let deadline = started + opts.broker_time;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..opts.broker_concurrency {
        let (client, ok, failed, first_error) = (
            bed.client.clone(),
            ok.clone(),
            failed.clone(),
            first_error.clone(),
        );
        tasks.spawn(async move {
            while Instant::now() < deadline {
                match broker_once(&client, crate::bed::ECHO_PORT).await {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        first_error
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert_with(|| e.to_string());
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let elapsed = started.elapsed();
    let cpu = procfs::cpu_seconds(bed.cp_pid, false)? - cpu_before;
    let credentials = ok.load(Ordering::Relaxed);
    let first_error = first_error.lock().unwrap_or_else(|p| p.into_inner()).take();
    Ok(BrokerRate {
        credentials,
        errors: failed.load(Ordering::Relaxed),
        first_error,
        elapsed,
        concurrency: opts.broker_concurrency,
        cp_cpu_per_credential: cpu / credentials.max(1) as f64,
    })
}
