//! One connection, in DESIGN §5 order: TLS accept (within the handshake
//! deadline) → request head (timeout,
//! size limit) → parse → verify (signature with a known kid → issuer →
//! audience → lifetime → time window) → single use → neighbor-MAC check → dial from this node's
//! overlay address → `101` → splice. Each step either passes or refuses with
//! a plain HTTP response, before any byte reaches a guest.
//!
//! The dialed address comes only from the verified credential: the parser
//! returns nothing but the bearer token.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::str::FromStr;
use std::time::Duration;

use crate::dial::{dial_from, DialError};
use crate::live::{Ending, Metered, NotAdmitted, Registration};
use otherix_core::connect::{ConnectRequest, HeadScanner, Parsed};
use otherix_core::conns::ConnectionSlot;
use otherix_core::credential::{Claims, Refusal};
use otherix_core::MacAddr;
use otherix_proto::agent::SessionEvent;
use socket2::{SockRef, TcpKeepalive};
use time::OffsetDateTime;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tracing::Instrument;

use super::overlay::Overlay;
use super::refused::{Fault, Refused};
use super::Gateway;
use crate::read_ahead::ReadAhead;
use crate::splice::{splice, End};

/// The answer that opens the tunnel.
const SWITCHING_PROTOCOLS: &[u8] =
    b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: otherix-tcp\r\n\r\n";
/// Longest time spent sending a refusal and waiting for the client to close.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(2);
/// Most bytes read and dropped after a refusal (so the close is not a reset
/// that could destroy the response in flight).
const REFUSAL_DRAIN: usize = 64 * 1024;

/// TLS over the client's TCP stream, read in large chunks (`read_ahead`).
type ClientStream = TlsStream<ReadAhead<TcpStream>>;

/// Why a connection stopped before its session.
enum Stop {
    /// Refused with an HTTP response.
    Refused(Refused),
    /// The client went away before its request head was complete.
    ClientGone,
}

impl<E: Into<Refused>> From<E> for Stop {
    fn from(e: E) -> Stop {
        Stop::Refused(e.into())
    }
}

/// What passed every check: the connected guest and the credential.
struct Admitted {
    guest: TcpStream,
    /// Bytes the client sent after its head: the start of the payload.
    early: Vec<u8>,
    claims: Claims,
    /// The credential as presented: session reports carry it, so the control
    /// plane can tell a session it issued from a forged report.
    credential: String,
    /// The session's place among the open ones (revocation ends it).
    live: Registration,
}

impl<O: Overlay> Gateway<O> {
    /// Serves one accepted connection to its end.
    /// Its handshake ends early when `slot`'s is cut for a newcomer.
    pub(crate) async fn handle(
        &self,
        tcp: TcpStream,
        peer: SocketAddr,
        acceptor: TlsAcceptor,
        slot: &mut ConnectionSlot,
    ) {
        let accepted = Instant::now();
        let deadline = accepted + self.config.limits.request_timeout;
        let handshake_deadline =
            accepted + (self.config.limits.handshake_timeout).min(self.config.limits.request_timeout);
        tune(&tcp, self.config.tcp_keepalive);
        let tcp = ReadAhead::new(tcp, self.config.limits.splice_buffer);
        let metrics = self.metrics.clone();
        let closed = self.closed.clone();
        let cut = slot.cut();
        let handshake = async move {
            let accept = acceptor.accept(tcp);
            tokio::pin!(accept);
            tokio::select! {
                done = &mut accept => match done {
                    Ok(tls) => return Some(tls),
                    Err(e) => tracing::debug!(error = %e, "TLS handshake failed"),
                },
                () = tokio::time::sleep_until(handshake_deadline) => {
                    tracing::debug!("TLS handshake timed out");
                    closed.refused("handshake_timeout", peer);
                }
                // The handshakes at their budget, and this the busiest
                // source's oldest: a newcomer has its place.
                () = cut => {
                    tracing::debug!("TLS handshake cut for a newcomer");
                    closed.refused("handshake_cut", peer);
                }
            }
            // Counted before the connection (still in `accept`) is closed.
            metrics.tls_failed();
            None
        };
        let handshake = self.handshakes.run(handshake.in_current_span());
        let Some(Some(mut tls)) = handshake.await else {
            return;
        };
        slot.established();
        match self.admit(&mut tls, deadline).await {
            Ok(admitted) => self.session(tls, admitted).await,
            Err(Stop::Refused(refused)) => self.refuse(&mut tls, &refused).await,
            Err(Stop::ClientGone) => {
                self.metrics.closed_before_head();
                tracing::debug!("client closed before its request head was complete");
            }
        }
    }

    /// Every check, in order; on success the guest is connected.
    async fn admit(&self, tls: &mut ClientStream, deadline: Instant) -> Result<Admitted, Stop> {
        let (request, early) = self.read_head(tls, deadline).await?;
        let now = OffsetDateTime::now_utc();
        let claims = self.verify(&request.bearer, now)?;
        let credential = request.bearer;
        let span = tracing::Span::current();
        span.record("vm", claims.vm.as_str());
        span.record("port", claims.port);
        span.record("net", claims.net.as_str());
        span.record("sub", claims.sub.as_str());
        span.record("jti", claims.jti.chars().take(8).collect::<String>().as_str());

        // Revoked, or the principal at its share: refused before its
        // credential takes a place in the replay cache.
        let live = self
            .live
            .register(&claims, self.config.max_sessions_per_principal)
            .map_err(|e| match e {
                NotAdmitted::Revoked => Refused::Credential(Refusal::Revoked),
                NotAdmitted::Duplicate => Refused::Credential(Refusal::Replayed),
                NotAdmitted::AtLimit { principal, limit } => Refused::PrincipalSessions { principal, limit },
            })?;
        self.replay().check_and_insert_for(
            &claims.jti,
            Some((&claims.sub, self.config.replay_share_per_principal)),
            claims.exp,
            now,
        )?;

        let (ip, mac) = target(&claims)?;
        self.check_neighbor(&claims.net, ip, mac).await?;
        let guest = self.dial(&claims, ip).await?;
        Ok(Admitted {
            guest,
            early,
            claims,
            credential,
            live,
        })
    }

    /// Reads until the request head is complete, within `deadline` and the
    /// size limit. Returns the request and the bytes read past the head.
    async fn read_head(
        &self,
        tls: &mut ClientStream,
        deadline: Instant,
    ) -> Result<(ConnectRequest, Vec<u8>), Stop> {
        let max = self.config.max_header_bytes;
        let mut buf = Vec::with_capacity(2048);
        // Looks only at what each read added: a head trickled in a byte at
        // a time costs work linear in its size.
        let mut scanner = HeadScanner::new();
        loop {
            if let Parsed::Complete { request, head_len } = scanner.feed(&buf, max)? {
                let early = buf.split_off(head_len);
                return Ok((request, early));
            }
            if buf.capacity() - buf.len() < 1024 {
                buf.reserve(4096);
            }
            match tokio::time::timeout_at(deadline, tls.read_buf(&mut buf)).await {
                Err(_) => return Err(Refused::HeadTimeout(self.config.limits.request_timeout).into()),
                Ok(Ok(0)) => return Err(Stop::ClientGone),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "reading the request head failed");
                    return Err(Stop::ClientGone);
                }
            }
        }
    }

    /// On the credential's overlay, the kernel's neighbor entry for `ip`
    /// must be the credential's MAC: if the IP now belongs to another guest
    /// the credential is stale, and nothing is dialed.
    async fn check_neighbor(&self, network: &str, ip: Ipv4Addr, mac: MacAddr) -> Result<(), Refused> {
        let lookup = self.overlay.neighbor_mac(network, ip);
        match tokio::time::timeout(self.config.limits.dial_timeout, lookup).await {
            Ok(Ok(Some(found))) if found == mac.octets() => Ok(()),
            Ok(Ok(Some(found))) => {
                tracing::info!(expected = %mac, found = %MacAddr(found), "neighbor entry holds another MAC");
                Err(Refused::TargetChanged {
                    ip,
                    mac: mac.to_string(),
                })
            }
            Ok(Ok(None)) => Err(Refused::NoNeighbor {
                ip,
                network: network.to_string(),
            }),
            Ok(Err(reason)) => {
                tracing::warn!(%reason, "neighbor lookup failed");
                Err(Refused::NeighborLookup {
                    network: network.to_string(),
                })
            }
            Err(_) => {
                tracing::warn!("neighbor lookup timed out");
                Err(Refused::NeighborLookup {
                    network: network.to_string(),
                })
            }
        }
    }

    /// Connects to `ip:claims.port` from this node's address on the overlay,
    /// through the overlay's device only.
    async fn dial(&self, claims: &Claims, ip: Ipv4Addr) -> Result<TcpStream, Refused> {
        let source = self
            .overlay
            .dial_source(&claims.net)
            .ok_or_else(|| Refused::NotOnNetwork {
                network: claims.net.clone(),
            })?;
        let addr = SocketAddrV4::new(ip, claims.port);
        let timeout = self.config.limits.dial_timeout;
        let guest = dial_from(
            source.address,
            Some(&source.device),
            addr,
            timeout,
            self.config.limits.guest_rto_min,
        )
        .await
        .map_err(|e| match e {
            DialError::Failed(e) => Refused::DialFailed {
                vm: claims.vm.clone(),
                addr,
                reason: e.to_string(),
            },
            DialError::TimedOut => Refused::DialTimeout {
                vm: claims.vm.clone(),
                addr,
                timeout,
            },
        })?;
        tune(&guest, self.config.tcp_keepalive);
        Ok(guest)
    }

    /// Opens the tunnel and splices until the session ends.
    async fn session(&self, mut tls: ClientStream, admitted: Admitted) {
        let Admitted {
            mut guest,
            early,
            claims,
            credential,
            mut live,
        } = admitted;
        let _open = self.metrics.open_session(&claims.net);
        self.metrics.accepted();
        let started = Instant::now();
        tracing::info!(principal = %claims.sub, vm = %claims.vm, port = claims.port, ip = %claims.ip, "session open");
        self.reports.push(
            SessionEvent::Start {
                session: claims.jti.clone(),
                at: OffsetDateTime::now_utc(),
                principal: claims.sub.clone(),
                vm: claims.vm.clone(),
                port: claims.port,
                network: claims.net.clone(),
                credential: Some(credential.clone()),
            },
            &self.metrics,
        );
        let opened = async {
            tls.write_all(SWITCHING_PROTOCOLS).await?;
            tls.flush().await?;
            guest.write_all(&early).await
        };
        if let Err(e) = opened.await {
            tracing::info!(error = %e, "session ended while opening");
            self.report_end(
                &claims,
                &credential,
                started,
                0,
                0,
                format!("ended while opening: {e}"),
            );
            return;
        }
        // A grant's credential says when its access ends: the session
        // ends then, as on a revocation, whatever `--max-session` allows.
        let access_left = claims.access_left(OffsetDateTime::now_utc());
        // Counted as it flows, so heartbeats report open sessions' bytes.
        let meter = live.meter.clone();
        meter.up(early.len() as u64);
        let outcome = splice(
            &mut Metered::new(&mut tls, &meter),
            &mut guest,
            self.config.limits.splice_buffer,
            self.config.limits.idle_timeout,
            self.config.limits.max_session,
            async {
                let expired = async {
                    match access_left {
                        Some(left) => tokio::time::sleep(left).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    // The sender goes only with the registration, which outlives this.
                    Ok(why) = &mut live.revoked => match why {
                        Ending::Revoked => End::Revoked,
                        Ending::EndedByAdmin => End::EndedByAdmin,
                    },
                    () = expired => End::GrantExpired,
                }
            },
        )
        .await;
        let to_guest = outcome.to_guest + early.len() as u64;
        self.metrics.bytes(to_guest, outcome.from_guest);
        let secs = started.elapsed().as_secs_f64();
        metrics::histogram!("otherix_gateway_session_duration_seconds").record(secs);
        let reason = match &outcome.end {
            Ok(end) => end.as_str().replace('_', " "),
            Err(e) => format!("connection error: {e}"),
        };
        self.report_end(
            &claims,
            &credential,
            started,
            to_guest,
            outcome.from_guest,
            reason,
        );
        match outcome.end {
            Ok(end) => tracing::info!(
                principal = %claims.sub,
                vm = %claims.vm,
                port = claims.port,
                to_guest,
                from_guest = outcome.from_guest,
                secs,
                end = end.as_str(),
                "session closed"
            ),
            Err(e) => tracing::info!(
                principal = %claims.sub,
                vm = %claims.vm,
                port = claims.port,
                to_guest,
                from_guest = outcome.from_guest,
                secs,
                end = "error",
                error = %e,
                "session closed"
            ),
        }
    }

    /// Queues the session's end for the control plane's audit trail.
    fn report_end(
        &self,
        claims: &Claims,
        credential: &str,
        started: Instant,
        up: u64,
        down: u64,
        reason: String,
    ) {
        self.reports.push(
            SessionEvent::End {
                session: claims.jti.clone(),
                at: OffsetDateTime::now_utc(),
                principal: claims.sub.clone(),
                vm: claims.vm.clone(),
                port: claims.port,
                network: claims.net.clone(),
                bytes_up: up,
                bytes_down: down,
                duration_ms: started.elapsed().as_millis() as u64,
                reason,
                credential: Some(credential.to_owned()),
            },
            &self.metrics,
        );
    }

    /// Counts and logs a refusal, sends its response, and closes politely:
    /// shut our side down, then read (and drop) until the client closes, so
    /// unread request bytes do not turn the close into a reset that could
    /// destroy the response in flight.
    pub(crate) async fn refuse<S>(&self, stream: &mut S, refused: &Refused)
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        self.metrics.refused(refused.code());
        let (code, status) = (refused.code(), refused.status());
        match refused.fault() {
            _ if matches!(refused, Refused::TooManyConnections) => {
                tracing::debug!(code, status, reason = %refused, "refused")
            }
            Fault::Client | Fault::Target => tracing::info!(code, status, reason = %refused, "refused"),
            Fault::Gateway => tracing::warn!(code, status, reason = %refused, "refused"),
        }
        let answer = async {
            stream.write_all(&refused.response()).await?;
            stream.shutdown().await?;
            let mut sink = [0u8; 4096];
            let mut drained = 0;
            while drained < REFUSAL_DRAIN {
                match stream.read(&mut sink).await? {
                    0 => break,
                    n => drained += n,
                }
            }
            Ok::<(), std::io::Error>(())
        };
        if let Ok(Err(e)) = tokio::time::timeout(REFUSAL_TIMEOUT, answer).await {
            tracing::debug!(error = %e, "sending the refusal failed");
        }
    }
}

/// The credential's IPv4 target and MAC. Both are signed by the CP; a
/// credential without them (a relay ticket) is not for a gateway.
fn target(claims: &Claims) -> Result<(Ipv4Addr, MacAddr), Refused> {
    let ip = Ipv4Addr::from_str(&claims.ip).map_err(|_| Refused::BadTarget("ip is not an IPv4 address"))?;
    let mac = claims.mac.as_deref().ok_or(Refused::BadTarget("no MAC"))?;
    let mac = MacAddr::from_str(mac).map_err(|_| Refused::BadTarget("mac is not a MAC address"))?;
    Ok((ip, mac))
}

/// No Nagle delay (a tunnel forwards what it gets, at once), keepalive
/// probes after `keepalive` of silence, and at most `keepalive` for what
/// the gateway sent to be acknowledged (`TCP_USER_TIMEOUT`, its FIN too),
/// so a peer that vanished without a FIN or RST is noticed: an idle one at
/// its second unanswered probe, one the gateway still had bytes or a FIN
/// for — a guest deleted while its client closes, its own FIN lost — after
/// `keepalive`, not after TCP's retransmissions (some 15 minutes), which
/// kept such a session, and the gateway's overlay with it, open that long.
fn tune(stream: &TcpStream, keepalive: Duration) {
    let _ = stream.set_nodelay(true);
    let params = TcpKeepalive::new().with_time(keepalive).with_interval(keepalive);
    if let Err(e) = SockRef::from(stream).set_tcp_keepalive(&params) {
        tracing::debug!(error = %e, "cannot set TCP keepalive");
    }
    let ms = u32::try_from(keepalive.as_millis()).unwrap_or(u32::MAX);
    if let Err(e) = nix::sys::socket::setsockopt(stream, nix::sys::socket::sockopt::TcpUserTimeout, &ms) {
        tracing::debug!(error = %e, "cannot set TCP_USER_TIMEOUT");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_leg_gives_up_on_what_its_peer_does_not_acknowledge_after_the_keepalive() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let leg = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        tune(&leg, Duration::from_secs(7));
        assert!(leg.nodelay().unwrap());
        let ms = nix::sys::socket::getsockopt(&leg, nix::sys::socket::sockopt::TcpUserTimeout).unwrap();
        assert_eq!(ms, 7_000);
        assert!(SockRef::from(&leg).keepalive().unwrap());
    }
}
