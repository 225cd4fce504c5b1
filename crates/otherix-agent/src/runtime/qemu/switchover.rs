//! The moment a QEMU guest leaves this node: its switchover.
//!
//! QEMU pauses the guest for the last pages and its devices' state, and the
//! guest goes on on the target. Frames for the guest that still reach this
//! node from then on (every member's FDB points here until the control plane
//! repoints it) used to reach a QEMU that would never read them again, and
//! waited for TCP's retransmission on the sender's side. So the source asks
//! QEMU to stop before the switchover (the `pause-before-switchover`
//! capability: status `pre-switchover`, the guest already paused), puts in
//! the forward of the guest's MAC on its overlay's VXLAN device
//! ([`crate::net::forward`]), and only then lets QEMU go on
//! (`migrate-continue`). The frames go to the target, whose tap holds them
//! while its QEMU is still receiving (a QEMU reads its tap only while the
//! guest runs), and the guest reads them the moment it runs there.
//!
//! A watcher task does it the instant QEMU says so: it has the guest's second
//! QMP monitor (`qmp-watch.sock`) to itself, waits for QEMU's `MIGRATION`
//! events, and wakes the agent's loop when the migration ends, so that the
//! move is reported at once rather than at the next poll. The agent's round
//! still follows `query-migrate` on the first monitor as before: should the
//! watcher be gone (an agent restarted meanwhile, a QEMU started before the
//! second monitor existed), the round does the same at the status it sees.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use super::qmp::{Qmp, QmpError};
use crate::net::forward::Forwarder;

/// Where frames for a guest that left go on from: the overlay's VXLAN
/// device and the guest's MAC, pinned there ([`Forwarder::pin`]) until the
/// round that sees the migration end unpins it.
#[derive(Debug, Clone)]
pub struct Forward {
    pub forwarder: Forwarder,
    pub device: String,
    pub mac: [u8; 6],
}

/// One outgoing migration's switchover, shared by its watcher and the rounds.
#[derive(Debug)]
pub struct Switchover {
    vm_id: String,
    forward: Option<Forward>,
    /// Whether the switchover is being let go or was (by the watcher or a
    /// round): once, unless QEMU did not take the `migrate-continue`.
    continued: AtomicBool,
    /// The forward's part, under a lock held across putting it in, so that
    /// the round's [`Switchover::end`] comes wholly before or after it.
    state: tokio::sync::Mutex<State>,
    /// Whether the watcher still follows QEMU's events.
    watching: AtomicBool,
}

impl Switchover {
    pub fn new(vm_id: &str, forward: Option<Forward>) -> Arc<Self> {
        Arc::new(Self {
            vm_id: vm_id.to_owned(),
            forward,
            continued: AtomicBool::new(false),
            state: tokio::sync::Mutex::new(State::default()),
            watching: AtomicBool::new(false),
        })
    }

    /// Whether a watcher follows this migration.
    pub fn watched(&self) -> bool {
        self.watching.load(Ordering::Acquire)
    }

    /// The forward put in at the switchover, if any.
    pub async fn fired(&self) -> Option<(String, [u8; 6])> {
        self.state.lock().await.fired.clone()
    }

    /// Ends the switchover (its migration ended, or is no longer asked for):
    /// no forward is put in after this. Returns the one put in, unpinned, for
    /// the round to take into what it holds (so that its convergence takes
    /// the rule away unless the guest moved).
    pub async fn end(&self) -> Option<(String, [u8; 6])> {
        let mut state = self.state.lock().await;
        state.ended = true;
        let (device, mac) = state.fired.take()?;
        if let Some(f) = &self.forward {
            f.forwarder.unpin(&device, mac);
        }
        Some((device, mac))
    }

    /// At `pre-switchover` (the guest paused for the last time here): puts in
    /// the forward, then lets QEMU go on; whether this call let it go. Once: a
    /// call after one that QEMU took does nothing, and so does one after
    /// [`Switchover::end`] (a migration no longer asked for, which the round
    /// cancels). The forward failing does not hold the migration: it only
    /// spares a retransmission.
    pub async fn let_go(&self, qmp: &mut Qmp) -> Result<bool, QmpError> {
        if self.continued.swap(true, Ordering::AcqRel) {
            return Ok(false);
        }
        let mut state = self.state.lock().await;
        if state.ended {
            return Ok(false);
        }
        if let (Some(f), false) = (&self.forward, std::mem::replace(&mut state.forward_tried, true)) {
            match f.forwarder.pin(&f.device, f.mac).await {
                Ok(()) => {
                    state.fired = Some((f.device.clone(), f.mac));
                    metrics::counter!("otherix_agent_qemu_switchover_forwards_total", "result" => "ok")
                        .increment(1);
                }
                Err(e) => {
                    metrics::counter!("otherix_agent_qemu_switchover_forwards_total", "result" => "failed")
                        .increment(1);
                    warn!(vm_id = %self.vm_id, device = %f.device, error = %crate::daemon::one_line(&e), "frames for the guest not forwarded at its switchover; the round puts the forward in once it has moved");
                }
            }
        }
        drop(state);
        let continued = qmp
            .execute("migrate-continue", Some(json!({ "state": "pre-switchover" })))
            .await;
        if let Err(e) = &continued {
            // A round tries again while QEMU still waits there.
            self.continued.store(false, Ordering::Release);
            warn!(vm_id = %self.vm_id, error = %e, "QEMU did not go on at the switchover");
        }
        continued.map(|_| true)
    }
}

#[derive(Debug, Default)]
struct State {
    /// The forward was tried (it is tried once).
    forward_tried: bool,
    /// The forward put in (device, MAC), pinned until [`Switchover::end`].
    fired: Option<(String, [u8; 6])>,
    /// [`Switchover::end`] was called.
    ended: bool,
}

/// Follows one migration on the guest's second monitor: lets it go at its
/// switchover, and wakes `wake` when it ends (or the watcher gives up, so
/// the round takes over). `qmp` must have been connected before the
/// migration was started, so that no event is missed.
pub async fn watch(mut qmp: Qmp, switchover: Arc<Switchover>, wake: Arc<Notify>, longest: Duration) {
    switchover.watching.store(true, Ordering::Release);
    let deadline = tokio::time::Instant::now() + longest;
    let ended = loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            break "the migration's time ran out".to_owned();
        }
        let event = match qmp.next_event(left).await {
            Ok(Some(event)) => event,
            Ok(None) => continue,
            Err(e) => break format!("QMP: {e}"),
        };
        if event["event"] != "MIGRATION" {
            continue;
        }
        let status = event["data"]["status"].as_str().unwrap_or_default();
        debug!(vm_id = %switchover.vm_id, %status, "QEMU migration event");
        match status {
            "pre-switchover" => match switchover.let_go(&mut qmp).await {
                Ok(true) => {
                    let forwarded = switchover.fired().await.is_some();
                    info!(vm_id = %switchover.vm_id, forwarded, "QEMU switchover: the guest leaves this node");
                }
                Ok(false) => {}
                Err(e) => break format!("migrate-continue: {e}"),
            },
            "completed" | "failed" | "cancelled" => break status.to_owned(),
            _ => {}
        }
    };
    debug!(vm_id = %switchover.vm_id, ended = %ended, "QEMU migration watcher ends");
    switchover.watching.store(false, Ordering::Release);
    wake.notify_one();
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    use tokio::net::UnixStream;

    /// QEMU's end of a QMP session, scripted by the test.
    struct Peer {
        lines: tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
        w: tokio::net::unix::OwnedWriteHalf,
    }

    impl Peer {
        async fn say(&mut self, line: &str) {
            self.w.write_all(format!("{line}\n").as_bytes()).await.unwrap();
        }

        async fn heard(&mut self) -> serde_json::Value {
            let line = tokio::time::timeout(Duration::from_secs(5), self.lines.next_line())
                .await
                .expect("a command in time")
                .unwrap()
                .expect("the session open");
            serde_json::from_str(&line).unwrap()
        }

        /// Nothing more is sent for a while.
        async fn hears_nothing(&mut self) {
            let next = tokio::time::timeout(Duration::from_millis(100), self.lines.next_line()).await;
            assert!(next.is_err(), "unexpected: {next:?}");
        }
    }

    async fn session() -> (Qmp, Peer) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (r, w) = theirs.into_split();
        let mut peer = Peer {
            lines: BufReader::new(r).lines(),
            w,
        };
        let client = tokio::spawn(Qmp::start(ours));
        peer.say(r#"{"QMP": {"version": {}, "capabilities": []}}"#).await;
        assert_eq!(peer.heard().await["execute"], "qmp_capabilities");
        peer.say(r#"{"return": {}}"#).await;
        (client.await.unwrap().unwrap(), peer)
    }

    /// A watcher of a migration without a forward, on a scripted session.
    async fn watched() -> (Peer, Arc<Switchover>, Arc<Notify>, tokio::task::JoinHandle<()>) {
        let (qmp, peer) = session().await;
        let switchover = Switchover::new("vm1", None);
        let wake = Arc::new(Notify::new());
        let watcher = tokio::spawn(watch(
            qmp,
            switchover.clone(),
            wake.clone(),
            Duration::from_secs(30),
        ));
        (peer, switchover, wake, watcher)
    }

    async fn woken_and_ended(wake: &Notify, watcher: tokio::task::JoinHandle<()>) {
        tokio::time::timeout(Duration::from_secs(5), wake.notified())
            .await
            .expect("the agent woken");
        watcher.await.unwrap();
    }

    fn is_continue(cmd: &serde_json::Value) -> bool {
        cmd["execute"] == "migrate-continue" && cmd["arguments"]["state"] == "pre-switchover"
    }

    #[tokio::test]
    async fn the_switchover_is_let_go_once_and_again_only_after_qemu_refused() {
        let (mut qmp, mut peer) = session().await;
        let switchover = Switchover::new("vm1", None);
        let answer = tokio::spawn(async move {
            assert!(is_continue(&peer.heard().await));
            peer.say(r#"{"error": {"class": "GenericError", "desc": "busy"}}"#)
                .await;
            assert!(is_continue(&peer.heard().await));
            peer.say(r#"{"return": {}}"#).await;
            peer.hears_nothing().await;
        });
        let refused = switchover.let_go(&mut qmp).await.unwrap_err();
        assert!(refused.to_string().contains("busy"), "{refused}");
        assert!(switchover.let_go(&mut qmp).await.unwrap());
        // Once taken, never again (a round after the watcher, say).
        assert!(!switchover.let_go(&mut qmp).await.unwrap());
        answer.await.unwrap();
        assert!(switchover.fired().await.is_none(), "no forward was asked for");
    }

    #[tokio::test]
    async fn a_switchover_ended_first_is_not_let_go_and_puts_nothing_in() {
        let (mut qmp, mut peer) = session().await;
        let switchover = Switchover::new("vm1", None);
        assert!(switchover.end().await.is_none());
        // The migration was rolled back (and cancelled) before QEMU got there.
        assert!(!switchover.let_go(&mut qmp).await.unwrap());
        peer.hears_nothing().await;
        assert!(switchover.fired().await.is_none());
    }

    #[tokio::test]
    async fn the_watcher_lets_the_switchover_go_and_wakes_the_agent_when_the_migration_ends() {
        let (mut peer, switchover, wake, watcher) = watched().await;
        // Other events and statuses pass by.
        peer.say(r#"{"event": "MIGRATION", "data": {"status": "active"}}"#)
            .await;
        peer.say(r#"{"event": "STOP"}"#).await;
        peer.hears_nothing().await;
        assert!(switchover.watched());
        peer.say(r#"{"event": "MIGRATION", "data": {"status": "pre-switchover"}}"#)
            .await;
        assert!(is_continue(&peer.heard().await));
        peer.say(r#"{"return": {}}"#).await;
        peer.say(r#"{"event": "MIGRATION", "data": {"status": "device"}}"#)
            .await;
        peer.say(r#"{"event": "MIGRATION", "data": {"status": "completed"}}"#)
            .await;
        woken_and_ended(&wake, watcher).await;
        assert!(!switchover.watched(), "the watcher ended");
    }

    #[tokio::test]
    async fn a_watcher_whose_monitor_closes_hands_over_to_the_rounds() {
        let (peer, switchover, wake, watcher) = watched().await;
        drop(peer);
        woken_and_ended(&wake, watcher).await;
        assert!(!switchover.watched(), "the round lets the switchover go now");
    }
}
