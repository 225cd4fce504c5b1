//! Typed HTTPS client for the control-plane API, over HTTP/1.1 with
//! keep-alive: a client (and its clones) keeps up to [`MAX_IDLE`] idle
//! connections and reuses them, so a long-running caller — `otherix
//! forward` brokering per connection, an agent's heartbeats — pays the TCP
//! and TLS handshakes once instead of per call. A request that could not
//! be written to a reused connection (the server closed it while idle) is
//! sent once more on a new one; nothing is resent once written.
//!
//! A client may know several control planes (replicas of one cluster: the
//! URLs given, and every address each name resolves to). It keeps using
//! the one that answered last; a new connection that cannot be made — the
//! replica is down, its port refuses, the TCP or TLS handshake does not
//! finish — is made to the next one instead. A certificate that is not the
//! cluster's is never skipped over: it is an error. Nothing that was sent
//! is sent again elsewhere.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, ServerName};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use otherix_proto::agent;
use otherix_proto::*;
use otherix_tls as tls;

/// Largest response body the client accepts.
const MAX_RESPONSE: usize = 64 << 20;
/// Idle connections kept per client for reuse.
pub const MAX_IDLE: usize = 64;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The connect timeout per address when there are other control planes to
/// try: a host that is gone (no answer at all) must not hold up the next
/// one for long.
const FAILOVER_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// The TLS handshake's, then (one alone waits as long as the request may).
const FAILOVER_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// VMs per page of [`Client::list_vms`] (the server's most).
pub const VM_PAGE: usize = 1000;
/// How often [`Client::list_vms`] waits out a rate-limited page.
const PAGE_RETRIES: u32 = 30;

/// What went wrong, and whose fault it is.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The server answered with an API error.
    #[error("{message}")]
    Api {
        status: u16,
        code: String,
        message: String,
    },
    /// The server's certificate does not chain to the pinned cluster CA.
    #[error("the server at {server} presented a certificate that is not signed by the pinned cluster CA ({reason})")]
    UntrustedServer { server: String, reason: String },
    /// The server's certificate is from the cluster CA but is not the
    /// control plane's: a node or a gateway answered (DESIGN §4).
    #[error(
        "the server at {server} is not this cluster's control plane: its certificate is from the cluster CA \
         but not a server certificate for {name} (a node or gateway answered at this address); check the server address"
    )]
    NotControlPlane { server: String, name: &'static str },
    #[error("cannot connect to {server}: {source}")]
    Connect {
        server: String,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS handshake with {server} failed: {reason}")]
    Tls { server: String, reason: String },
    /// Several control planes were tried and none could be reached.
    #[error("no control plane could be reached: {tried}")]
    Unreachable { tried: String },
    #[error("invalid server URL {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("request to {server} timed out")]
    Timeout { server: String },
    #[error("unexpected answer from {server}: {reason}")]
    Protocol { server: String, reason: String },
    /// A name given to the client is not one the CP would accept; nothing
    /// was sent.
    #[error(transparent)]
    InvalidName(#[from] InvalidName),
}

impl ClientError {
    /// The API error code, when the server answered with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    /// The HTTP status, when the server answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A parsed `https://host:port` endpoint.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub url: String,
    pub host: String,
    pub port: u16,
    pub server_name: ServerName<'static>,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Self, ClientError> {
        let bad = |reason: &str| ClientError::BadUrl {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri = url.parse().map_err(|_| bad("not a URL"))?;
        if uri.scheme_str() != Some("https") {
            return Err(bad("the scheme must be https"));
        }
        let host = uri.host().ok_or_else(|| bad("no host"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
        let port = uri.port_u16().unwrap_or(443);
        let server_name = ServerName::try_from(host.clone()).map_err(|_| bad("invalid host name"))?;
        let trimmed = url.trim_end_matches('/').to_string();
        Ok(Endpoint {
            url: trimmed,
            host,
            port,
            server_name,
        })
    }

    /// A control plane's endpoint: dialed at its host, verified by
    /// [`tls::CP_NAME`] — never by the host, which a node or gateway
    /// certificate of the same CA could name.
    pub fn control_plane(url: &str) -> Result<Self, ClientError> {
        Ok(Endpoint {
            server_name: tls::cp_server_name(),
            ..Endpoint::parse(url)?
        })
    }
}

/// The control plane URLs a client is given: one, or several replicas of
/// one cluster.
pub trait ServerList {
    fn urls(&self) -> Vec<&str>;
}

impl ServerList for &str {
    fn urls(&self) -> Vec<&str> {
        vec![self]
    }
}

impl ServerList for &String {
    fn urls(&self) -> Vec<&str> {
        vec![self.as_str()]
    }
}

impl ServerList for &[String] {
    fn urls(&self) -> Vec<&str> {
        self.iter().map(String::as_str).collect()
    }
}

impl ServerList for &Vec<String> {
    fn urls(&self) -> Vec<&str> {
        self.iter().map(String::as_str).collect()
    }
}

/// Parses every URL of `servers` as a control plane's endpoint.
fn control_planes(servers: impl ServerList) -> Result<Arc<[Endpoint]>, ClientError> {
    let urls = servers.urls();
    if urls.is_empty() {
        return Err(ClientError::BadUrl {
            url: String::new(),
            reason: "no control plane URL given".into(),
        });
    }
    let mut endpoints = Vec::with_capacity(urls.len());
    for url in urls {
        let ep = Endpoint::control_plane(url)?;
        if !endpoints.iter().any(|e: &Endpoint| e.url == ep.url) {
            endpoints.push(ep);
        }
    }
    Ok(endpoints.into())
}

/// A client of a control plane (or of several replicas of one), trusting
/// one cluster CA.
#[derive(Clone)]
pub struct Client {
    endpoints: Arc<[Endpoint]>,
    /// The endpoint that answered last: new connections go there first.
    current: Arc<AtomicUsize>,
    connector: TlsConnector,
    bearer: Option<Arc<str>>,
    /// Idle keep-alive connections, shared by clones.
    idle: Arc<Mutex<Vec<Sender>>>,
}

/// A connection ready for requests, the `Host` its requests carry, and
/// which control plane it reaches.
struct Sender {
    send: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    host: String,
    endpoint: usize,
}

impl std::ops::Deref for Sender {
    type Target = hyper::client::conn::http1::SendRequest<Full<Bytes>>;
    fn deref(&self) -> &Self::Target {
        &self.send
    }
}

impl std::ops::DerefMut for Sender {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.send
    }
}

/// `req` with the `Host` of the connection it goes on.
fn with_host(mut req: Request<Full<Bytes>>, host: &str) -> Request<Full<Bytes>> {
    if let Ok(v) = http::HeaderValue::from_str(host) {
        req.headers_mut().insert(header::HOST, v);
    }
    req
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the bearer secret.
        f.debug_struct("Client").field("server", &self.server()).finish()
    }
}

impl Client {
    /// A client that trusts only `ca_pem` and authenticates with `bearer`.
    pub fn new(servers: impl ServerList, ca_pem: &str, bearer: Option<String>) -> Result<Self, ClientError> {
        let endpoints = control_planes(servers)?;
        let tls_err = |e: tls::TlsError| ClientError::Tls {
            server: endpoints[0].url.clone(),
            reason: e.to_string(),
        };
        let ca = tls::cert_from_pem(ca_pem).map_err(tls_err)?;
        let config = tls::pinned_client_config(ca).map_err(tls_err)?;
        Ok(Client {
            endpoints,
            current: Arc::default(),
            connector: TlsConnector::from(Arc::new(config)),
            bearer: bearer.map(Arc::from),
            idle: Arc::default(),
        })
    }

    /// A client that also presents a client certificate (mutual TLS): how
    /// an enrolled agent talks to the CP.
    pub fn with_identity(
        servers: impl ServerList,
        ca_pem: &str,
        cert_pem: &str,
        key_pem: &str,
    ) -> Result<Self, ClientError> {
        let endpoints = control_planes(servers)?;
        let tls_err = |e: tls::TlsError| ClientError::Tls {
            server: endpoints[0].url.clone(),
            reason: e.to_string(),
        };
        let ca = tls::cert_from_pem(ca_pem).map_err(tls_err)?;
        let config = tls::pinned_client_config_with_identity(ca, cert_pem, key_pem).map_err(tls_err)?;
        Ok(Client {
            endpoints,
            current: Arc::default(),
            connector: TlsConnector::from(Arc::new(config)),
            bearer: None,
            idle: Arc::default(),
        })
    }

    /// The same control planes, with the one in use kept, and another
    /// client certificate (an agent's renewed one).
    pub fn with_new_identity(
        &self,
        ca_pem: &str,
        cert_pem: &str,
        key_pem: &str,
    ) -> Result<Self, ClientError> {
        let renewed = Client::with_identity(&self.servers(), ca_pem, cert_pem, key_pem)?;
        renewed
            .current
            .store(self.current.load(Ordering::Relaxed), Ordering::Relaxed);
        Ok(renewed)
    }

    /// The URL of the control plane in use: the one that answered last.
    pub fn server(&self) -> &str {
        &self.endpoint().url
    }

    /// Every control plane URL this client knows, as given.
    pub fn servers(&self) -> Vec<String> {
        self.endpoints.iter().map(|e| e.url.clone()).collect()
    }

    fn endpoint(&self) -> &Endpoint {
        &self.endpoints[self.current.load(Ordering::Relaxed) % self.endpoints.len()]
    }

    /// The bearer secret this client presents (its principal's API token or
    /// grant token), if any: what a relay session resumes with
    /// ([`crate::tunnel::Resume`]). A secret: never log it.
    pub fn bearer(&self) -> Option<&str> {
        self.bearer.as_deref()
    }

    /// The same client with another bearer secret.
    pub fn with_bearer(&self, bearer: Option<String>) -> Self {
        Client {
            bearer: bearer.map(Arc::from),
            ..self.clone()
        }
    }

    /// Connects to a control plane of `servers` (the first that answers),
    /// checks that the cluster CA it presents has the fingerprint
    /// `expected` (or, with `None`, accepts whatever CA it shows, for a
    /// person to confirm), and returns that CA certificate.
    pub async fn discover_ca(
        servers: impl ServerList,
        expected: Option<[u8; 32]>,
    ) -> Result<CertificateDer<'static>, ClientError> {
        let endpoints = control_planes(servers)?;
        let verifier = tls::DiscoveringVerifier::new(expected);
        let config = rustls::ClientConfig::builder_with_provider(tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| ClientError::Tls {
                server: endpoints[0].url.clone(),
                reason: e.to_string(),
            })?
            .dangerous()
            .with_custom_certificate_verifier(verifier.clone())
            .with_no_client_auth();
        let connector = TlsConnector::from(Arc::new(config));
        let (i, _stream) = connect_any(&endpoints, 0, &connector).await?;
        verifier.found_ca().ok_or_else(|| ClientError::Tls {
            server: endpoints[i].url.clone(),
            reason: "server presented no CA".into(),
        })
    }

    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        self.call(Method::GET, path, None::<&()>).await
    }

    pub async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, ClientError> {
        self.call(Method::POST, path, Some(body)).await
    }

    pub async fn patch<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, ClientError> {
        self.call(Method::PATCH, path, Some(body)).await
    }

    pub async fn delete(&self, path: &str) -> Result<(), ClientError> {
        let _: serde_json::Value = self.call(Method::DELETE, path, None::<&()>).await?;
        Ok(())
    }

    /// Sends one request and decodes the JSON answer (or the API error).
    /// A replica that answers `replica_unavailable` did nothing with it (it
    /// lost its database): the request goes to the next one, once each.
    pub async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ClientError> {
        let mut tries = self.endpoints.len();
        loop {
            let fut = self.call_inner(method.clone(), path, body);
            let result = match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
                Ok(r) => r,
                Err(_) => Err(ClientError::Timeout {
                    server: self.server().to_string(),
                }),
            };
            tries -= 1;
            match result {
                Err(e) if tries > 0 && e.code() == Some(REPLICA_UNAVAILABLE) => {
                    let n = self.endpoints.len();
                    let from = self.current.load(Ordering::Relaxed) % n;
                    tracing::info!(from = %self.endpoints[from].url, to = %self.endpoints[(from + 1) % n].url, "control plane replica lost its database; using another");
                    self.current.store((from + 1) % n, Ordering::Relaxed);
                }
                other => return other,
            }
        }
    }

    async fn call_inner<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ClientError> {
        let server = self.server().to_string();
        let protocol = |reason: String| ClientError::Protocol {
            server: server.clone(),
            reason,
        };
        let payload = match body {
            Some(b) => Bytes::from(serde_json::to_vec(b).map_err(|e| protocol(e.to_string()))?),
            None => Bytes::new(),
        };
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(header::ACCEPT, "application/json")
            .header(header::USER_AGENT, concat!("otherix/", env!("CARGO_PKG_VERSION")));
        if body.is_some() {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        if let Some(bearer) = &self.bearer {
            req = req.header(header::AUTHORIZATION, format!("Bearer {bearer}"));
        }
        let req = req
            .body(Full::new(payload))
            .map_err(|e| protocol(e.to_string()))?;
        let idle = match self.take_idle() {
            Some(mut s) => s.ready().await.is_ok().then_some(s),
            None => None,
        };
        let (mut sender, reused) = match idle {
            Some(s) => (s, true),
            None => (self.open().await?, false),
        };
        let req = with_host(req, &sender.host);
        let resp = match sender.send.try_send_request(req).await {
            Ok(resp) => resp,
            Err(mut e) => match e.take_message() {
                // Never written: the idle connection was gone. Once more, anew
                // (to another replica if this one is gone too).
                Some(req) if reused => {
                    sender = self.open().await?;
                    let req = with_host(req, &sender.host);
                    sender
                        .send
                        .send_request(req)
                        .await
                        .map_err(|e| protocol(e.to_string()))?
                }
                _ => return Err(protocol(e.into_error().to_string())),
            },
        };
        let status = resp.status();
        let bytes = Limited::new(resp.into_body(), MAX_RESPONSE)
            .collect()
            .await
            .map_err(|e| protocol(format!("reading body: {e}")))?
            .to_bytes();
        self.keep_idle(sender);
        if !status.is_success() {
            return Err(api_error(status, &bytes));
        }
        let bytes = if bytes.is_empty() {
            Bytes::from_static(b"null")
        } else {
            bytes
        };
        serde_json::from_slice(&bytes).map_err(|e| protocol(format!("invalid JSON: {e}")))
    }

    /// A new connection: TCP, TLS (the pinned CA), HTTP/1.1 — to the
    /// control plane in use, or the next one that answers.
    async fn open(&self) -> Result<Sender, ClientError> {
        let first = self.current.load(Ordering::Relaxed);
        let (i, tls) = connect_any(&self.endpoints, first, &self.connector).await?;
        let ep = &self.endpoints[i];
        if i != first % self.endpoints.len() {
            tracing::info!(from = %self.endpoints[first % self.endpoints.len()].url, to = %ep.url, "control plane unreachable; using another replica");
            self.current.store(i, Ordering::Relaxed);
        }
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| ClientError::Protocol {
                server: ep.url.clone(),
                reason: e.to_string(),
            })?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Sender {
            send,
            host: format!("{}:{}", ep.host, ep.port),
            endpoint: i,
        })
    }

    /// The newest idle connection still open to the control plane in use,
    /// if any (those to another, which it moved away from, are dropped).
    fn take_idle(&self) -> Option<Sender> {
        let current = self.current.load(Ordering::Relaxed) % self.endpoints.len();
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(s) = idle.pop() {
            if !s.is_closed() && s.endpoint == current {
                return Some(s);
            }
        }
        None
    }

    /// Keeps a connection whose answer was read in full, if it can carry another.
    fn keep_idle(&self, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(sender);
        }
    }

    // Typed calls, one per endpoint the CLI uses.

    pub async fn info(&self) -> Result<ServerInfo, ClientError> {
        self.get("/v1/info").await
    }
    pub async fn whoami(&self) -> Result<WhoAmI, ClientError> {
        self.get("/v1/whoami").await
    }
    pub async fn create_user(&self, req: &CreateUserRequest) -> Result<User, ClientError> {
        self.post("/v1/users", req).await
    }
    pub async fn list_users(&self) -> Result<Vec<User>, ClientError> {
        self.get("/v1/users").await
    }
    pub async fn get_user(&self, name: &str) -> Result<User, ClientError> {
        self.get(&format!("/v1/users/{}", path_segment(name))).await
    }
    pub async fn delete_user(&self, name: &str) -> Result<(), ClientError> {
        self.delete(&format!("/v1/users/{}", path_segment(name))).await
    }
    /// A token for `user`, living `ttl_seconds` (`None`: the server's
    /// default lifetime).
    pub async fn create_token(
        &self,
        user: &str,
        ttl_seconds: Option<u64>,
    ) -> Result<CreatedToken, ClientError> {
        self.post(
            &format!("/v1/users/{}/tokens", path_segment(user)),
            &otherix_proto::CreateTokenRequest { ttl_seconds },
        )
        .await
    }
    pub async fn revoke_token(&self, user: &str, id: &str) -> Result<(), ClientError> {
        self.delete(&format!(
            "/v1/users/{}/tokens/{}",
            path_segment(user),
            path_segment(id)
        ))
        .await
    }
    pub async fn allow(&self, user: &str, req: &AllowRequest) -> Result<User, ClientError> {
        self.post(&format!("/v1/users/{}/rules", path_segment(user)), req)
            .await
    }
    pub async fn disallow(&self, user: &str, rule: i64) -> Result<(), ClientError> {
        self.delete(&format!("/v1/users/{}/rules/{rule}", path_segment(user)))
            .await
    }
    pub async fn create_network(&self, req: &CreateNetworkRequest) -> Result<Network, ClientError> {
        self.post("/v1/networks", req).await
    }
    pub async fn list_networks(&self) -> Result<Vec<Network>, ClientError> {
        self.get("/v1/networks").await
    }
    pub async fn get_network(&self, name: &str) -> Result<Network, ClientError> {
        self.get(&format!("/v1/networks/{}", path_segment(name))).await
    }
    pub async fn delete_network(&self, name: &str) -> Result<(), ClientError> {
        self.delete(&format!("/v1/networks/{}", path_segment(name))).await
    }
    /// A bridge network also exists on `node` (idempotent).
    pub async fn add_network_node(&self, network: &str, node: &NodeName) -> Result<Network, ClientError> {
        self.post(
            &format!("/v1/networks/{}/nodes", path_segment(network)),
            &AddNetworkNodeRequest { node: node.clone() },
        )
        .await
    }
    /// A bridge network no longer exists on `node` (refused while it hosts
    /// VMs of it).
    pub async fn remove_network_node(&self, network: &str, node: &str) -> Result<Network, ClientError> {
        self.call(
            Method::DELETE,
            &format!(
                "/v1/networks/{}/nodes/{}",
                path_segment(network),
                path_segment(node)
            ),
            None::<&()>,
        )
        .await
    }
    pub async fn create_vm(&self, req: &CreateVmRequest) -> Result<Vm, ClientError> {
        self.post("/v1/vms", req).await
    }
    /// Several VMs in one transaction, all or none.
    pub async fn create_vm_batch(
        &self,
        req: &otherix_proto::CreateVmBatchRequest,
    ) -> Result<otherix_proto::VmBatch, ClientError> {
        self.post("/v1/vm-batches", req).await
    }
    /// Every VM (matching `selector`), fetched a page of [`VM_PAGE`] at a time.
    pub async fn list_vms(&self, selector: Option<&str>) -> Result<Vec<Vm>, ClientError> {
        let mut all: Vec<Vm> = Vec::new();
        let mut limited = 0;
        loop {
            let page = match self
                .list_vms_page(selector, all.last().map(|vm| vm.name.as_str()), VM_PAGE)
                .await
            {
                // Pages count against the caller's list rate: a very large
                // list waits for its bucket rather than failing half-way.
                Err(e) if e.status() == Some(429) && limited < PAGE_RETRIES => {
                    limited += 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                other => other?,
            };
            let last = page.len() < VM_PAGE;
            all.extend(page);
            if last {
                return Ok(all);
            }
        }
    }

    /// One page of `vm list`: at most `limit` VMs whose names sort after `after`.
    pub async fn list_vms_page(
        &self,
        selector: Option<&str>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Vm>, ClientError> {
        let mut path = format!("/v1/vms?limit={limit}");
        if let Some(s) = selector {
            path.push_str(&format!("&selector={}", query_value(s)));
        }
        if let Some(a) = after {
            path.push_str(&format!("&after={}", query_value(a)));
        }
        self.get(&path).await
    }
    pub async fn get_vm(&self, name: &str) -> Result<Vm, ClientError> {
        self.get(&format!("/v1/vms/{}", path_segment(name))).await
    }
    pub async fn delete_vm(&self, name: &str) -> Result<(), ClientError> {
        self.delete(&format!("/v1/vms/{}", path_segment(name))).await
    }
    pub async fn broker(&self, req: &BrokerRequest) -> Result<BrokerResponse, ClientError> {
        self.post("/v1/broker", req).await
    }
    pub async fn create_lb(&self, req: &CreateLbRequest) -> Result<LoadBalancer, ClientError> {
        self.post("/v1/lbs", req).await
    }
    pub async fn list_lbs(&self) -> Result<Vec<LoadBalancer>, ClientError> {
        self.get("/v1/lbs").await
    }
    pub async fn get_lb(&self, name: &str) -> Result<LoadBalancer, ClientError> {
        self.get(&format!("/v1/lbs/{}", path_segment(name))).await
    }
    pub async fn update_lb(&self, name: &str, req: &UpdateLbRequest) -> Result<LoadBalancer, ClientError> {
        self.patch(&format!("/v1/lbs/{}", path_segment(name)), req).await
    }
    pub async fn delete_lb(&self, name: &str) -> Result<(), ClientError> {
        self.delete(&format!("/v1/lbs/{}", path_segment(name))).await
    }
    pub async fn create_grant(&self, req: &CreateGrantRequest) -> Result<CreatedGrant, ClientError> {
        self.post("/v1/grants", req).await
    }
    pub async fn list_grants(&self) -> Result<Vec<Grant>, ClientError> {
        self.get("/v1/grants").await
    }
    pub async fn get_grant(&self, name: &str) -> Result<Grant, ClientError> {
        self.get(&format!("/v1/grants/{}", path_segment(name))).await
    }
    /// Session signing keys, newest first (public facts only).
    pub async fn keys(&self) -> Result<Vec<SessionKeyInfo>, ClientError> {
        self.get("/v1/keys").await
    }

    /// Rotates the session signing key now; answers once the new key signs.
    pub async fn rotate_keys(&self) -> Result<KeyRotation, ClientError> {
        self.post("/v1/keys/rotate", &serde_json::json!({})).await
    }

    pub async fn revoke_grant(&self, name: &str) -> Result<Grant, ClientError> {
        self.post(
            &format!("/v1/grants/{}/revoke", path_segment(name)),
            &serde_json::json!({}),
        )
        .await
    }
    /// The audit trail of the last `since_seconds`, optionally filtered.
    /// One page of the audit trail (`limit` events at most, after the
    /// cursor `after` — a previous page's `next`).
    pub async fn audit(&self, q: &AuditQuery<'_>) -> Result<AuditPage, ClientError> {
        let mut path = format!("/v1/audit?since_seconds={}", q.since_seconds);
        for (k, v) in [
            ("principal", q.principal),
            ("target", q.target),
            ("after", q.after),
        ] {
            if let Some(v) = v {
                path.push_str(&format!("&{k}={}", query_value(v)));
            }
        }
        if let Some(limit) = q.limit {
            path.push_str(&format!("&limit={limit}"));
        }
        self.get(&path).await
    }
    /// Sessions open now, optionally only those of a principal, to a VM,
    /// or through a node.
    pub async fn sessions(
        &self,
        principal: Option<&str>,
        target: Option<&str>,
        node: Option<&str>,
    ) -> Result<Vec<OpenSession>, ClientError> {
        let query: Vec<String> = [("principal", principal), ("target", target), ("node", node)]
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k}={}", query_value(v))))
            .collect();
        if query.is_empty() {
            self.get("/v1/sessions").await
        } else {
            self.get(&format!("/v1/sessions?{}", query.join("&"))).await
        }
    }

    /// Ends one open session (admins): that session only, with reason
    /// `ended by an admin`. Returns it as it was listed.
    pub async fn end_session(&self, id: &str) -> Result<OpenSession, ClientError> {
        self.post(
            &format!("/v1/sessions/{}/end", path_segment(id)),
            &serde_json::json!({}),
        )
        .await
    }

    pub async fn create_join_token(
        &self,
        req: &agent::CreateJoinTokenRequest,
    ) -> Result<agent::JoinToken, ClientError> {
        self.post("/v1/join-tokens", req).await
    }
    pub async fn enroll(&self, req: &agent::EnrollRequest) -> Result<agent::EnrollResponse, ClientError> {
        self.post("/v1/agent/enroll", req).await
    }
    pub async fn heartbeat(&self, hb: &agent::Heartbeat) -> Result<agent::DesiredState, ClientError> {
        self.post("/v1/agent/heartbeat", hb).await
    }
    /// Held open by the control plane until this node's desired state is no
    /// longer `version` (or about 25 s): see [`agent::DesiredWait`].
    pub async fn wait_desired(&self, version: u64) -> Result<agent::DesiredWait, ClientError> {
        self.get(&format!("/v1/agent/desired/wait?version={version}"))
            .await
    }
    /// A certificate for the node's own key (mutual TLS): renewal of its
    /// client certificate, or a serving certificate for a granted role.
    pub async fn certificate(
        &self,
        req: &agent::CertificateRequest,
    ) -> Result<agent::CertificateResponse, ClientError> {
        self.post("/v1/agent/certificate", req).await
    }
    pub async fn update_node(
        &self,
        name: &str,
        req: &agent::UpdateNodeRequest,
    ) -> Result<agent::Node, ClientError> {
        self.patch(&format!("/v1/nodes/{}", path_segment(name)), req)
            .await
    }
    pub async fn list_nodes(&self) -> Result<Vec<agent::Node>, ClientError> {
        self.get("/v1/nodes").await
    }
    pub async fn get_node(&self, name: &str) -> Result<agent::Node, ClientError> {
        self.get(&format!("/v1/nodes/{}", path_segment(name))).await
    }
    pub async fn delete_node(&self, name: &str, force: bool) -> Result<(), ClientError> {
        self.delete(&format!("/v1/nodes/{}?force={force}", path_segment(name)))
            .await
    }
    /// A relay ticket for VM `name`'s serial console (admin).
    pub async fn console(&self, name: &str) -> Result<BrokerResponse, ClientError> {
        self.post(
            &format!("/v1/vms/{}/console", path_segment(name)),
            &serde_json::json!({}),
        )
        .await
    }
    pub async fn migrate_vm(&self, name: &str, to: &NodeName) -> Result<Vm, ClientError> {
        self.post(
            &format!("/v1/vms/{}/migrate", path_segment(name)),
            &MigrateVmRequest { to: to.clone() },
        )
        .await
    }
    pub async fn label_vm(&self, name: &str, req: &LabelVmRequest) -> Result<Vm, ClientError> {
        self.patch(&format!("/v1/vms/{}/labels", path_segment(name)), req)
            .await
    }
}

/// Connects to the first of `endpoints`, from `first` on and round, that
/// answers — every address its host resolves to, in turn — and returns
/// which one it was. Only a connection that could not be made moves on: a
/// server that answered with a certificate that is not the cluster's
/// control plane's, or any other TLS verdict, is an error at once.
async fn connect_any(
    endpoints: &[Endpoint],
    first: usize,
    connector: &TlsConnector,
) -> Result<(usize, tokio_rustls::client::TlsStream<TcpStream>), ClientError> {
    let n = endpoints.len();
    let mut failures: Vec<ClientError> = Vec::new();
    for k in 0..n {
        let i = (first + k) % n;
        match connect_tls(&endpoints[i], connector, n > 1).await {
            Ok(stream) => return Ok((i, stream)),
            Err(Attempt::Unreachable(e)) => failures.push(e),
            Err(Attempt::Answered(e)) => return Err(e),
        }
    }
    if failures.len() == 1 {
        return Err(failures.remove(0));
    }
    Err(ClientError::Unreachable {
        tried: failures
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; "),
    })
}

/// Why a connection was not made.
enum Attempt {
    /// Nothing answered (refused, no route, no answer in time, the
    /// handshake cut short): another replica may.
    Unreachable(ClientError),
    /// The server answered, wrongly (its certificate, a TLS alert): final.
    Answered(ClientError),
}

/// TCP to each address of `endpoint` in turn, then TLS. With `failover`
/// (other control planes to try) the waits are shorter: a host that is
/// gone must not hold up the next one for long.
async fn connect_tls(
    endpoint: &Endpoint,
    connector: &TlsConnector,
    failover: bool,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, Attempt> {
    let connect_timeout = if failover {
        FAILOVER_CONNECT_TIMEOUT
    } else {
        CONNECT_TIMEOUT
    };
    let connect_err = |source| ClientError::Connect {
        server: endpoint.url.clone(),
        source,
    };
    let timeout = || ClientError::Timeout {
        server: endpoint.url.clone(),
    };
    let addrs: Vec<SocketAddr> = match endpoint.host.parse::<std::net::IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, endpoint.port)],
        Err(_) => tokio::net::lookup_host((endpoint.host.as_str(), endpoint.port))
            .await
            .map_err(|e| Attempt::Unreachable(connect_err(e)))?
            .collect(),
    };
    let mut last = None;
    for addr in addrs {
        let tcp = match tokio::time::timeout(connect_timeout, TcpStream::connect(addr)).await {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(source)) => {
                last = Some(connect_err(source));
                continue;
            }
            Err(_) => {
                last = Some(timeout());
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let handshake = connector.connect(endpoint.server_name.clone(), tcp);
        let done = if failover {
            match tokio::time::timeout(FAILOVER_HANDSHAKE_TIMEOUT, handshake).await {
                Ok(done) => done,
                Err(_) => {
                    last = Some(timeout());
                    continue;
                }
            }
        } else {
            handshake.await
        };
        match done {
            Ok(stream) => return Ok(stream),
            // A TLS verdict (the certificate, an alert): the server answered.
            Err(e) if e.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()) => {
                return Err(Attempt::Answered(tls_error(&endpoint.url, e)))
            }
            // Cut short (EOF, reset): it stopped meanwhile.
            Err(e) => last = Some(tls_error(&endpoint.url, e)),
        }
    }
    Err(Attempt::Unreachable(last.unwrap_or_else(|| {
        connect_err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "the name resolves to no address",
        ))
    })))
}

/// Turns a handshake failure into the error a person can act on.
fn tls_error(server: &str, err: std::io::Error) -> ClientError {
    let server = server.to_string();
    if let Some(tls) = err.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) {
        return match tls {
            rustls::Error::InvalidCertificate(cert) => match cert {
                rustls::CertificateError::UnknownIssuer | rustls::CertificateError::BadSignature => {
                    ClientError::UntrustedServer {
                        server,
                        reason: "unknown issuer; if the cluster was rebuilt, run `otherix login` again"
                            .into(),
                    }
                }
                // Signed by the cluster CA, but not the control plane's: a
                // node's or a gateway's certificate (DESIGN §4).
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. }
                | rustls::CertificateError::InvalidPurpose
                | rustls::CertificateError::InvalidPurposeContext { .. } => ClientError::NotControlPlane {
                    server,
                    name: tls::CP_NAME,
                },
                other => ClientError::Tls {
                    server,
                    reason: format!("invalid server certificate: {other:?}"),
                },
            },
            rustls::Error::General(msg) => ClientError::Tls {
                server,
                reason: msg.clone(),
            },
            other => ClientError::Tls {
                server,
                reason: other.to_string(),
            },
        };
    }
    ClientError::Tls {
        server,
        reason: err.to_string(),
    }
}

fn api_error(status: StatusCode, body: &[u8]) -> ClientError {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) => ClientError::Api {
            status: status.as_u16(),
            code: e.error.code,
            message: e.error.message,
        },
        Err(_) => ClientError::Api {
            status: status.as_u16(),
            code: "http_error".into(),
            message: format!(
                "server answered {status}: {}",
                String::from_utf8_lossy(&body[..body.len().min(200)]).trim()
            ),
        },
    }
}

/// Percent-encodes one path segment (names are DNS labels, but never trust that).
pub fn path_segment(s: &str) -> String {
    encode(s, |b| b.is_ascii_alphanumeric() || b"-._~".contains(&b))
}

/// Percent-encodes a query value.
pub fn query_value(s: &str) -> String {
    encode(s, |b| b.is_ascii_alphanumeric() || b"-._~".contains(&b))
}

fn encode(s: &str, keep: impl Fn(u8) -> bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if keep(b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// What [`Client::audit`] asks for.
#[derive(Debug, Clone, Copy, Default)]
pub struct AuditQuery<'a> {
    /// Only events of the last N seconds.
    pub since_seconds: u64,
    /// Only this principal (`user:NAME`, `grant:NAME`).
    pub principal: Option<&'a str>,
    /// Only this target.
    pub target: Option<&'a str>,
    /// Events in the page [server default: 500, at most 5000].
    pub limit: Option<u32>,
    /// A previous page's `next`.
    pub after: Option<&'a str>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_requires_https() {
        let err = Endpoint::parse("http://127.0.0.1:7443").unwrap_err();
        assert!(err.to_string().contains("https"), "{err}");
    }

    #[test]
    fn endpoint_parses_ip_and_default_port() {
        let e = Endpoint::parse("https://10.1.2.3/").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("10.1.2.3", 443));
        assert_eq!(e.url, "https://10.1.2.3");
    }

    #[test]
    fn path_segments_are_escaped() {
        assert_eq!(path_segment("a/b c"), "a%2Fb%20c");
        assert_eq!(query_value("app in (a,b)"), "app%20in%20%28a%2Cb%29");
    }
}
