//! The daemon's web surface on loopback, behind a token: a live dashboard,
//! Prometheus metrics, and the same controls as the CLI.
//!
//! # Guarantees
//! - Every route but `/healthz` needs the token (`?token=` once, after which
//!   the page holds it in an HttpOnly, SameSite=Strict cookie; or
//!   `Authorization: Bearer`). A request without it gets 401.
//! - A request that changes anything is a POST that also passes a
//!   same-origin check: its `Origin` (or `Referer`) must be this daemon's
//!   address; a browser request from another origin gets 403. A request
//!   that names no origin at all is taken only with the token in an
//!   `Authorization` header, which a cross-site page cannot set.
//! - Bodies are at most [`BODY_LEN_MAX`] bytes (413 past that) of JSON (400
//!   when malformed); a refused request changes nothing.
//! - Controls go through the control protocol's own handler
//!   ([`ControlHandler::answer`]), so they follow the same rules as the CLI.
//!
//! About 1,000 lines in one file because every route shares the token check,
//! the connection caps and the refusal helpers; the page and the metrics
//! live apart.

#[cfg(test)]
mod bench;
mod page;

use crate::metrics;
pub(crate) use crate::metrics::{Metered, Metrics};

use crate::control::ControlHandler;
use crate::jobs::service::JobState;
use crate::protocol::{ControlRequest, ControlResponse};
use crate::state::StateDir;
use anyhow::{Context, Result};
use axum::Router;
use axum::body::Body;
use axum::extract::{Path as UrlPath, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use swactor_actors::{ClusterError, ClusterEvent, ClusterGlance, ClusterSnapshot};
use swactor_engine::telemetry::{TelemetryFrame, TelemetryHandler, decode_frame};
use swactor_providers::Provider;
use swactor_provisioning::{ApplyError, DesiredUpdate, Generation, LogicalNodeId, UpdateError};

/// How long a view waits for the cluster's own glance before it takes the
/// one the driver left after its last step: a driver in the middle of a
/// large pass answers late, and `/metrics` should not wait for it.
const GLANCE_WAIT: Duration = Duration::from_millis(5);

/// Largest request body, in bytes.
pub(crate) const BODY_LEN_MAX: usize = 16 * 1024;

/// Lines of a node's log the node view shows, and how far back it reads.
const LOG_LINES_MAX: usize = 40;
const LOG_TAIL_BYTES: u64 = 8 * 1024;

/// Everything the web surface serves from.
#[derive(Debug)]
pub(crate) struct Web {
    /// The control protocol's handler: the same answers as the CLI gets.
    pub(crate) control: ControlHandler,
    /// The telemetry publisher's handler, for the pages' event streams.
    pub(crate) telemetry: TelemetryHandler,
    /// The metrics.
    pub(crate) metrics: Arc<Metrics>,
    /// The access token.
    pub(crate) token: String,
    /// The state directory (node logs are read from it).
    pub(crate) state_dir: PathBuf,
    /// The address served on.
    pub(crate) addr: SocketAddr,
}

/// The file that keeps the web surface's address between daemons.
const ADDR_FILE: &str = "http.addr";
/// The file that keeps the token (0600).
const TOKEN_FILE: &str = "http.token";

/// Binds the web surface: `requested` if given, else the address the last
/// daemon used, else a free port on 127.0.0.1. The address is saved in the
/// state directory.
///
/// # Errors
/// A requested address that cannot be bound, or an unwritable state directory.
pub(crate) async fn bind(
    state: &StateDir,
    requested: Option<SocketAddr>,
) -> Result<tokio::net::TcpListener> {
    let path = state.root().join(ADDR_FILE);
    let listener = if let Some(addr) = requested {
        tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr} for the web surface (--http)"))?
    } else {
        let saved: Option<SocketAddr> = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse().ok());
        let fresh = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
        match saved {
            Some(addr) => match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => l,
                Err(e) => {
                    // Bookmarks and scrapers hold the old port: say plainly that it moved.
                    let l = tokio::net::TcpListener::bind(fresh).await?;
                    let why = if e.kind() == std::io::ErrorKind::AddrInUse {
                        "is taken".to_owned()
                    } else {
                        format!("cannot be used ({e})")
                    };
                    eprintln!(
                        "swactor: the dashboard's port {}, kept in {} from the last daemon, {why}; \
                         it uses port {} instead, and keeps that one (--http ADDR:PORT picks one)",
                        addr.port(),
                        path.display(),
                        l.local_addr()?.port()
                    );
                    l
                }
            },
            None => tokio::net::TcpListener::bind(fresh).await?,
        }
    };
    let addr = listener.local_addr()?;
    crate::state::write_atomic(&path, addr.to_string().as_bytes(), 0o600)?;
    Ok(listener)
}

/// The access token in the state directory, made (0600) on first use.
///
/// # Errors
/// The file cannot be read or written.
pub(crate) fn token(state: &StateDir) -> Result<String> {
    let path = state.root().join(TOKEN_FILE);
    if let Ok(text) = std::fs::read_to_string(&path) {
        let text = text.trim();
        if text.len() >= 32 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(text.to_owned());
        }
    }
    let mut bytes = [0u8; 24];
    let mut urandom = std::fs::File::open("/dev/urandom").context("open /dev/urandom")?;
    std::io::Read::read_exact(&mut urandom, &mut bytes).context("read /dev/urandom")?;
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    crate::state::write_atomic(&path, token.as_bytes(), 0o600)?;
    Ok(token)
}

/// Serves `web` on `listener` until the daemon exits.
pub(crate) fn serve(listener: tokio::net::TcpListener, web: Arc<Web>) -> WebServer {
    let router = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/", get(index))
        .route("/app.js", get(script))
        .route("/metrics", get(scrape))
        .route("/events", get(events))
        .route("/api/status", get(api_status))
        .route("/api/history", get(api_history))
        .route("/api/jobs", get(api_jobs))
        .route("/api/node/{node}", get(api_node))
        .route("/api/scale", post(api_scale))
        .route("/api/replace", post(api_replace))
        .route("/api/pause", post(api_pause))
        .route("/api/resume", post(api_resume))
        .route("/api/teardown", post(api_teardown))
        .layer(middleware::from_fn_with_state(web.clone(), guard))
        .with_state(web.clone());
    WebServer([
        tokio::spawn(accept(
            listener,
            router,
            ConnectionLimits::for_this_process(),
        )),
        tokio::spawn(follow(web)),
    ])
}

/// The web surface while it serves: dropping it stops accepting, closes
/// the connections it holds and stops sampling (a daemon whose term of
/// leadership ended lets go of everything it served with).
pub(crate) struct WebServer([tokio::task::JoinHandle<()>; 2]);

impl Drop for WebServer {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// How many connections the web surface holds at once and how long an idle
/// one may stay.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnectionLimits {
    /// Connections served at once; one past it is closed as soon as it is
    /// accepted (event streams count too).
    pub(crate) connections_max: usize,
    /// How long a connection may take to send a request's headers, or sit
    /// idle between requests, before it is closed.
    pub(crate) header_timeout: Duration,
}

impl ConnectionLimits {
    /// The most connections ever held, however many descriptors there are.
    pub(crate) const CONNECTIONS_MAX: usize = 1_024;
    /// Header (and keep-alive idle) timeout.
    pub(crate) const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

    /// At most a quarter of this process's descriptors (the rest are for
    /// the providers' work: pipes, sockets, log files), and never more than
    /// [`Self::CONNECTIONS_MAX`].
    pub(crate) fn for_this_process() -> Self {
        let descriptors = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        let quarter = usize::try_from(descriptors / 4).unwrap_or(usize::MAX);
        Self {
            connections_max: quarter.clamp(16, Self::CONNECTIONS_MAX),
            header_timeout: Self::HEADER_TIMEOUT,
        }
    }
}

/// Accepts connections for `router`, at most `limits.connections_max` at
/// once; each is closed when it sends no complete request head within
/// `limits.header_timeout` (a first request, or the next on a kept-alive
/// connection).
///
/// At the cap, the oldest connection that is doing nothing (no request
/// being answered, no event stream being sent) is closed to make room, so
/// idle connections cannot keep `/healthz` or a dashboard out; when every
/// connection is busy, the new one is closed at once and counted. An accept
/// that fails (out of descriptors) is retried after a pause, so a flood can
/// neither hold descriptors the daemon needs nor spin the loop.
/// The connections being served; closed when the accept loop ends.
#[derive(Default)]
struct OpenConnections(std::collections::VecDeque<Arc<Connection>>);

impl std::ops::Deref for OpenConnections {
    type Target = std::collections::VecDeque<Arc<Connection>>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for OpenConnections {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for OpenConnections {
    fn drop(&mut self) {
        for c in &self.0 {
            c.ended.store(true, Ordering::Relaxed);
            c.close.notify_one();
        }
    }
}

async fn accept(listener: tokio::net::TcpListener, router: Router, limits: ConnectionLimits) {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.connections_max));
    let mut open = OpenConnections::default();
    let mut refused = RefusedConnections::default();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                refused.failed_accept(&e);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        open.retain(|c| !c.ended.load(Ordering::Relaxed));
        let slot = match Arc::clone(&slots).try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                let Some(idle) = open.iter().find(|c| c.busy.load(Ordering::Relaxed) == 0) else {
                    drop(stream);
                    refused.over_cap(limits.connections_max);
                    continue;
                };
                idle.ended.store(true, Ordering::Relaxed);
                idle.close.notify_one();
                match tokio::time::timeout(
                    Duration::from_secs(1),
                    Arc::clone(&slots).acquire_owned(),
                )
                .await
                {
                    Ok(Ok(slot)) => slot,
                    _ => {
                        drop(stream);
                        refused.over_cap(limits.connections_max);
                        continue;
                    }
                }
            }
        };
        let conn = Arc::new(Connection::default());
        open.push_back(Arc::clone(&conn));
        let service = hyper_util::service::TowerToHyperService::new(
            router
                .clone()
                .layer(middleware::from_fn(busy_while_answering))
                .layer(axum::Extension(Arc::clone(&conn))),
        );
        tokio::spawn(async move {
            let _slot = slot;
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let served = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::select! {
                served = served => {
                    if let Err(e) = served {
                        tracing::debug!(%e, "a web connection ended with an error");
                    }
                }
                // Shed to make room: dropping the connection closes it.
                () = conn.close.notified() => {}
            }
            conn.ended.store(true, Ordering::Relaxed);
        });
    }
}

/// One connection of the web surface, as the accept loop sees it.
#[derive(Default)]
struct Connection {
    /// Requests being answered on it (an event stream counts until it ends).
    busy: AtomicUsize,
    /// It has ended, or was chosen to be closed.
    ended: AtomicBool,
    /// Told to close.
    close: tokio::sync::Notify,
}

/// Counts a request as busy on its connection until its response has been
/// sent, body included (a streamed body until the stream ends).
async fn busy_while_answering(
    axum::Extension(conn): axum::Extension<Arc<Connection>>,
    req: Request,
    next: Next,
) -> Response {
    struct Busy(Arc<Connection>);
    impl Drop for Busy {
        fn drop(&mut self) {
            self.0.busy.fetch_sub(1, Ordering::Relaxed);
        }
    }
    conn.busy.fetch_add(1, Ordering::Relaxed);
    let busy = Busy(conn);
    let response = next.run(req).await;
    if axum::body::HttpBody::size_hint(response.body())
        .exact()
        .is_some()
    {
        // Whole in memory: written at once.
        return response;
    }
    let (parts, body) = response.into_parts();
    let stream = futures_util::StreamExt::map(body.into_data_stream(), move |chunk| {
        let _busy = &busy;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// Connections the web surface closed unserved, said at most once a minute.
#[derive(Default)]
struct RefusedConnections {
    since_said: u64,
    said_at: Option<std::time::Instant>,
}

impl RefusedConnections {
    const SAY_EVERY: Duration = Duration::from_secs(60);

    fn over_cap(&mut self, max: usize) {
        self.since_said += 1;
        if self
            .said_at
            .is_none_or(|at| at.elapsed() >= Self::SAY_EVERY)
        {
            tracing::warn!(
                refused = self.since_said,
                "the web surface holds {max} connections, its most; closed {} more at once \
                 since this was last said",
                self.since_said
            );
            self.since_said = 0;
            self.said_at = Some(std::time::Instant::now());
        }
    }

    fn failed_accept(&mut self, e: &std::io::Error) {
        if self
            .said_at
            .is_none_or(|at| at.elapsed() >= Self::SAY_EVERY)
        {
            tracing::warn!(%e, "the web surface could not accept a connection; retrying");
            self.said_at = Some(std::time::Instant::now());
        }
    }
}

/// Feeds the metrics from the cluster's events, and takes a point for the
/// dashboard's plot every [`metrics::SAMPLE_EVERY`]. A cluster restarted by
/// its supervisor ends the subscription; it is taken again.
async fn follow(web: Arc<Web>) {
    let mut tick = tokio::time::interval(metrics::SAMPLE_EVERY);
    loop {
        let mut sub = match web.control.cluster.subscribe().await {
            Ok(sub) => sub,
            Err(_) => {
                tick.tick().await;
                web.metrics.sample(wall_ms(), None);
                continue;
            }
        };
        web.metrics.seed(&sub.snapshot);
        drop(sub.snapshot);
        loop {
            tokio::select! {
                event = sub.events.recv() => match event {
                    Ok(event) => web.metrics.observe(&event),
                    // What was skipped is missed by the durations and
                    // convergence times only: the nodes and replacements
                    // are counted by the cluster itself.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                },
                _ = tick.tick() => {
                    let ready = web.glance().await.ok().map(|g| g.ready());
                    web.metrics.sample(wall_ms(), ready);
                }
            }
        }
    }
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

// ----- the guard -----

/// Compares without stopping at the first difference.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// Where a request's token came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Credential {
    Header,
    Cookie,
    Query,
}

fn cookie_name(web: &Web) -> String {
    // Cookies are per host, not per port: two daemons on one machine must
    // not overwrite each other's.
    format!("swactor_token_{}", web.addr.port())
}

fn credential(web: &Web, req: &Request) -> Option<Credential> {
    let headers = req.headers();
    if let Some(auth) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        return auth
            .strip_prefix("Bearer ")
            .filter(|t| same_secret(t.trim(), &web.token))
            .map(|_| Credential::Header);
    }
    let name = cookie_name(web);
    let from_cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .any(|(k, v)| k == name && same_secret(v, &web.token));
    if from_cookie {
        return Some(Credential::Cookie);
    }
    let from_query = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .any(|(k, v)| k == "token" && same_secret(v, &web.token));
    from_query.then_some(Credential::Query)
}

/// Whether the Host header names this daemon (a page of another site that
/// resolves its own name to 127.0.0.1 does not).
fn host_ok(web: &Web, headers: &HeaderMap) -> bool {
    if !web.addr.ip().is_loopback() {
        return true;
    }
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let port = web.addr.port();
    [
        web.addr.to_string(),
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
    ]
    .iter()
    .any(|h| h.eq_ignore_ascii_case(host))
}

/// Whether a state-changing request comes from this daemon's own pages.
fn same_origin(headers: &HeaderMap, by: Credential) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let ours = format!("http://{host}");
    if let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        return origin.eq_ignore_ascii_case(&ours);
    }
    if let Some(referer) = headers.get(header::REFERER).and_then(|v| v.to_str().ok()) {
        return referer == ours || referer.starts_with(&format!("{ours}/"));
    }
    // No origin named: a script or `curl`, not a browser page. Only a token
    // in a header (which no other site's page can send) lets it through.
    by == Credential::Header
}

async fn guard(State(web): State<Arc<Web>>, req: Request, next: Next) -> Response {
    if req.uri().path() == "/healthz" {
        return next.run(req).await;
    }
    if !host_ok(&web, req.headers()) {
        return refuse(
            StatusCode::FORBIDDEN,
            "the Host header does not name this daemon's address; open the URL `swactor up` \
             printed",
        );
    }
    let Some(by) = credential(&web, &req) else {
        return refuse(
            StatusCode::UNAUTHORIZED,
            &format!(
                "this needs the daemon's access token: open the URL `swactor up` printed (it \
                 ends in ?token=…), or send `Authorization: Bearer TOKEN`; the token is in {}",
                web.state_dir.join(TOKEN_FILE).display()
            ),
        );
    };
    if req.method() == Method::POST && !same_origin(req.headers(), by) {
        return refuse(
            StatusCode::FORBIDDEN,
            "refused: the request comes from another origin than this daemon's page; nothing \
             was changed",
        );
    }
    if by == Credential::Query && req.method() == Method::GET && req.uri().path() == "/" {
        // Keep the token out of the address bar and the history from here on.
        let mut resp = (StatusCode::SEE_OTHER, [(header::LOCATION, "/")]).into_response();
        set_cookie(&web, &mut resp);
        return resp;
    }
    let mut resp = next.run(req).await;
    if by == Credential::Query {
        set_cookie(&web, &mut resp);
    }
    resp
}

fn set_cookie(web: &Web, resp: &mut Response) {
    let cookie = format!(
        "{}={}; HttpOnly; SameSite=Strict; Path=/",
        cookie_name(web),
        web.token
    );
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        resp.headers_mut().append(header::SET_COOKIE, v);
    }
}

/// A refusal: the status and a message, as JSON `{"error": …}`.
fn refuse(code: StatusCode, message: &str) -> Response {
    (code, axum::Json(json!({ "error": message }))).into_response()
}

fn ok(value: Value) -> Response {
    axum::Json(value).into_response()
}

/// The body as JSON (an empty body is `null`).
async fn body_json(body: Body) -> Result<Value, Response> {
    let bytes = axum::body::to_bytes(body, BODY_LEN_MAX)
        .await
        .map_err(|_| {
            refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!(
                    "the request body is larger than {} KiB; nothing was changed",
                    BODY_LEN_MAX / 1024
                ),
            )
        })?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        refuse(
            StatusCode::BAD_REQUEST,
            &format!("the request body is not valid JSON ({e}); nothing was changed"),
        )
    })
}

// ----- reading -----

impl Web {
    /// The status, exactly as `swactor status --json` gets it.
    async fn status(&self) -> Result<ClusterSnapshot, Response> {
        match self.control.answer(ControlRequest::Status).await {
            ControlResponse::Status(snap) => Ok(snap),
            ControlResponse::Error(e) => Err(refuse(StatusCode::SERVICE_UNAVAILABLE, &e)),
            _ => Err(refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                "unexpected answer",
            )),
        }
    }

    /// The cluster's glance (see [`crate::metrics`]): asked of the driver,
    /// or, when it is busy or has not answered within [`GLANCE_WAIT`], the
    /// one it left after its last step.
    async fn glance(&self) -> Result<ClusterGlance, ClusterError> {
        let cluster = &self.control.cluster;
        if cluster.busy()
            && let Some(glance) = cluster.last_glance()
        {
            return Ok(glance);
        }
        match tokio::time::timeout(GLANCE_WAIT, cluster.glance()).await {
            Ok(answer) => answer,
            Err(_) => match cluster.last_glance() {
                Some(glance) => Ok(glance),
                None => cluster.glance().await,
            },
        }
    }

    /// The status (every node, for the page's table) and each desired
    /// group's desired and ready nodes, from the cluster's counts.
    async fn overview(&self) -> Result<Overview, Response> {
        let status = self.status().await?;
        let groups = match self.glance().await {
            Ok(glance) => glance
                .groups
                .iter()
                .filter_map(|g| {
                    Some(GroupLine {
                        id: g.id.to_string(),
                        desired: g.desired?,
                        ready: g.counts.ready,
                    })
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        let wall_ms = wall_ms();
        // Who leads, in the words `swactor status` uses; only when several
        // daemons share the run, so a daemon alone answers as before.
        let leader = status
            .ha
            .as_ref()
            .map(|ha| crate::words::leader_line(ha, wall_ms));
        Ok(Overview {
            status,
            groups,
            wall_ms,
            leader,
        })
    }
}

/// What the dashboard reads (`/api/status`, and the page as it is first
/// served): the status, each desired group's counts, the wall clock and,
/// when several daemons share the run, who leads. Written as JSON straight
/// from these types: a status of 100,000 nodes is never made into a tree
/// of JSON values first.
#[derive(Debug, serde::Serialize)]
struct Overview {
    status: ClusterSnapshot,
    groups: Vec<GroupLine>,
    wall_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    leader: Option<String>,
}

/// One desired group on the dashboard.
#[derive(Debug, serde::Serialize)]
struct GroupLine {
    id: String,
    desired: u32,
    ready: u64,
}

async fn index(State(web): State<Arc<Web>>) -> Response {
    match web.overview().await {
        Ok(overview) => {
            let overview = serde_json::to_value(&overview).unwrap_or(Value::Null);
            (
                [(header::CACHE_CONTROL, "no-store")],
                axum::response::Html(page::render(&overview)),
            )
                .into_response()
        }
        Err(resp) => resp,
    }
}

async fn script() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        page::SCRIPT,
    )
        .into_response()
}

/// `/metrics`: the cluster's glance (no node is copied, see
/// [`crate::metrics`]) and the daemon's own figures beside it.
async fn scrape(State(web): State<Arc<Web>>) -> Response {
    let glance = match web.glance().await {
        Ok(g) => g,
        Err(e) => return refuse(StatusCode::SERVICE_UNAVAILABLE, &web.control.refused(&e)),
    };
    let scraped = metrics::Scraped {
        rentals: web.control.rentals_now().await,
        spend: web.control.spend(glance.spend),
        ha: web.control.ha.get(),
        glance,
        subscribers: web.telemetry.subscriber_count(),
        priced: if web.control.vast.is_some() {
            vec!["vast"]
        } else {
            Vec::new()
        },
        convergence: None,
    };
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        web.metrics.encode(scraped),
    )
        .into_response()
}

async fn api_status(State(web): State<Arc<Web>>) -> Response {
    web.overview()
        .await
        .map_or_else(|r| r, |o| axum::Json(o).into_response())
}

async fn api_history(State(web): State<Arc<Web>>) -> Response {
    let points: Vec<Value> = web
        .metrics
        .samples()
        .into_iter()
        .map(|(at_ms, ready, passes)| json!({ "at_ms": at_ms, "ready": ready, "passes": passes }))
        .collect();
    ok(json!({ "every_ms": metrics::SAMPLE_EVERY.as_millis() as u64, "points": points }))
}

/// Jobs shown at most, newest first: the queue and what ran last.
const JOBS_SHOWN_MAX: usize = 50;

/// The jobs for the dashboard, newest first: each one's state, where it
/// runs (or why it waits), and how far its runs are.
async fn api_jobs(State(web): State<Arc<Web>>) -> Response {
    let jobs = web.control.jobs.list();
    let total = jobs.len();
    let queued = jobs.iter().filter(|j| j.waiting.is_some()).count();
    let shown: Vec<Value> = jobs
        .iter()
        .rev()
        .take(JOBS_SHOWN_MAX)
        .map(|j| {
            let succeeded = j.runs.iter().filter(|r| r.state == JobState::Succeeded).count();
            json!({
                "id": j.id,
                "state": j.state().word(),
                "waiting": j.waiting.as_deref().map(|w| w.strip_prefix("queued: ").unwrap_or(w)),
                "priority": j.priority,
                "gang": j.gang.as_ref().map(|g| json!({ "nodes": g.nodes, "restarts": g.restarts, "retry": g.retry })),
                "nodes": j.runs.iter().map(|r| r.node.to_string()).collect::<Vec<_>>(),
                "runs": j.runs.len(),
                "succeeded": succeeded,
                "ended": j.cancelled,
                "command": crate::words::cut(&j.argv.join(" ")),
            })
        })
        .collect();
    ok(json!({ "total": total, "queued": queued, "jobs": shown }))
}

async fn api_node(State(web): State<Arc<Web>>, UrlPath(node): UrlPath<String>) -> Response {
    let Some(id) = LogicalNodeId::parse(&node) else {
        return refuse(
            StatusCode::BAD_REQUEST,
            &crate::control::not_a_node_id(&node),
        );
    };
    let described = match web.control.answer(ControlRequest::Describe(node)).await {
        ControlResponse::Described(d) => d,
        ControlResponse::Error(e) => return refuse(StatusCode::NOT_FOUND, &e),
        _ => return refuse(StatusCode::INTERNAL_SERVER_ERROR, "unexpected answer"),
    };
    let log = log_tail(&web, &id);
    ok(json!({ "node": described, "log": log }))
}

/// The last lines of the node's latest local agent log, if it has one here.
fn log_tail(web: &Web, node: &LogicalNodeId) -> Value {
    use std::io::{Read, Seek, SeekFrom};
    let run = web.control.run_id.clone();
    let Ok(logs) = swactor_providers::process::agent_logs(&web.state_dir, &run, node) else {
        return Value::Null;
    };
    let Some(latest) = logs.iter().max_by_key(|l| l.attempt) else {
        return Value::Null;
    };
    let Ok(mut file) = std::fs::File::open(&latest.path) else {
        return Value::Null;
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)));
    let mut bytes = Vec::new();
    let _ = file.take(LOG_TAIL_BYTES).read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(LOG_LINES_MAX);
    json!({
        "attempt": latest.attempt.0,
        "live": latest.live,
        "lines": lines[from..],
    })
}

// ----- the event stream -----

async fn events(State(web): State<Arc<Web>>) -> Response {
    let Some(sub) = web.telemetry.subscribe_local() else {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many telemetry subscribers; close a page or a `swactor watch`",
        );
    };
    let stream = futures_util::stream::unfold((sub, web), |(mut sub, web)| async move {
        let frame = sub.next_frame().await?;
        let event = sse_event(&web, &frame);
        Some((Ok::<_, Infallible>(event), (sub, web)))
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

/// One telemetry frame as a server-sent event (`snapshot`, `event` or
/// `lagged`), with what the provider says of each node's lease filled in.
fn sse_event(web: &Web, frame: &[u8]) -> Event {
    let describe = |n: &mut swactor_actors::NodeSummary| {
        n.resource = n
            .lease
            .as_ref()
            .and_then(|l| web.control.provider.describe_lease(l));
    };
    let data = match decode_frame::<ClusterSnapshot, ClusterEvent>(frame) {
        Ok(TelemetryFrame::Snapshot { seq, mut state }) => {
            state.nodes.iter_mut().for_each(describe);
            ("snapshot", json!({ "seq": seq, "state": state }))
        }
        Ok(TelemetryFrame::Event {
            seq,
            at_ms,
            mut event,
        }) => {
            if let ClusterEvent::Node(n) = &mut event {
                describe(n);
            }
            (
                "event",
                json!({ "seq": seq, "at_ms": at_ms, "event": event }),
            )
        }
        Ok(TelemetryFrame::Lagged { missed }) => ("lagged", json!({ "missed": missed })),
        Err(e) => ("error", json!({ "error": e.to_string() })),
    };
    Event::default()
        .event(data.0)
        .json_data(data.1)
        .unwrap_or_else(|_| Event::default().event("error"))
}

// ----- controls -----

/// The control answer as a response; a refusal (the request was valid, the
/// cluster said no: a node already failed, a teardown under way) is 409.
fn answered(resp: ControlResponse) -> Response {
    match resp {
        ControlResponse::Error(e) => refuse(StatusCode::CONFLICT, &e),
        other => ok(serde_json::to_value(other).unwrap_or(Value::Null)),
    }
}

async fn api_pause(State(web): State<Arc<Web>>, body: Body) -> Response {
    if let Err(resp) = body_json(body).await {
        return resp;
    }
    answered(web.control.answer(ControlRequest::Pause).await)
}

async fn api_resume(State(web): State<Arc<Web>>, body: Body) -> Response {
    if let Err(resp) = body_json(body).await {
        return resp;
    }
    answered(web.control.answer(ControlRequest::Resume).await)
}

async fn api_teardown(State(web): State<Arc<Web>>, body: Body) -> Response {
    let body = match body_json(body).await {
        Ok(v) => v,
        Err(resp) => return resp,
    };
    if body.get("confirm") != Some(&Value::Bool(true)) {
        return refuse(
            StatusCode::BAD_REQUEST,
            "a teardown destroys every node and stops the daemon: send {\"confirm\": true}; \
             nothing was changed",
        );
    }
    // The answer comes only once every node is gone; the page follows the
    // teardown on its event stream meanwhile.
    let control = web.control.clone();
    tokio::spawn(async move {
        let _ = control
            .answer(ControlRequest::Down {
                keep: false,
                purge: false,
            })
            .await;
    });
    (
        StatusCode::ACCEPTED,
        axum::Json(
            json!({ "message": "tearing down: every node is destroyed, then the daemon stops" }),
        ),
    )
        .into_response()
}

async fn api_replace(State(web): State<Arc<Web>>, body: Body) -> Response {
    let body = match body_json(body).await {
        Ok(v) => v,
        Err(resp) => return resp,
    };
    let Some(node) = body.get("node").and_then(Value::as_str) else {
        return refuse(
            StatusCode::BAD_REQUEST,
            "send {\"node\": \"GROUP-INDEX\"}; nothing was changed",
        );
    };
    let Some(id) = LogicalNodeId::parse(node) else {
        return refuse(
            StatusCode::BAD_REQUEST,
            &crate::control::not_a_node_id(node),
        );
    };
    match web.control.cluster.describe(id).await {
        Ok(d) if d.as_ref().is_none_or(|d| d.summary.is_none()) => {
            return refuse(
                StatusCode::NOT_FOUND,
                &format!(
                    "run {} has no node {}; nothing was changed",
                    web.control.run_id,
                    crate::words::cut(node)
                ),
            );
        }
        Ok(_) => {}
        Err(e) => return refuse(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
    answered(
        web.control
            .answer(ControlRequest::Replace(node.to_owned()))
            .await,
    )
}

async fn api_scale(State(web): State<Arc<Web>>, body: Body) -> Response {
    let body = match body_json(body).await {
        Ok(v) => v,
        Err(resp) => return resp,
    };
    let (Some(group), Some(count)) = (body.get("group").and_then(Value::as_str), body.get("count"))
    else {
        return refuse(
            StatusCode::BAD_REQUEST,
            "send {\"group\": \"ID\", \"count\": N}; nothing was changed",
        );
    };
    let count = match count.as_i64() {
        Some(n) if n < 0 => {
            return refuse(
                StatusCode::BAD_REQUEST,
                &format!(
                    "a group cannot have {n} nodes: the count is 0 or more; nothing was changed"
                ),
            );
        }
        Some(n) => match u32::try_from(n) {
            Ok(n) => n,
            Err(_) => {
                return refuse(
                    StatusCode::BAD_REQUEST,
                    &format!("{n} nodes is more than any group can have; nothing was changed"),
                );
            }
        },
        None => {
            return refuse(
                StatusCode::BAD_REQUEST,
                &format!("count {count} is not a whole number of nodes; nothing was changed"),
            );
        }
    };
    let yes = body.get("yes") == Some(&Value::Bool(true));
    scale(&web, group, count, yes).await
}

/// Offers the shape on record with one group's count changed, as the next
/// generation: the cluster judges it as it judges any `apply` (capacity,
/// limits, generation rules). A change `apply` would ask about (it destroys
/// nodes, or creates more than 20 at once) needs `yes`, as `apply` needs
/// `--yes` without a terminal; without it the answer (409) says why in
/// `confirm`, for the page to ask.
async fn scale(web: &Web, group: &str, count: u32, yes: bool) -> Response {
    let view = match web.control.cluster.desired().await {
        Ok(v) => v,
        Err(e) => return refuse(StatusCode::SERVICE_UNAVAILABLE, &web.control.refused(&e)),
    };
    let Some(mut shape) = view.shape.clone() else {
        return refuse(
            StatusCode::CONFLICT,
            "the daemon has no shape yet; nothing was changed",
        );
    };
    let Some(g) = shape.groups.iter_mut().find(|g| g.id == group) else {
        let known: Vec<&str> = shape.groups.iter().map(|g| g.id.as_str()).collect();
        return refuse(
            StatusCode::NOT_FOUND,
            &format!(
                "the shape has no group {:?} (it has: {}); nothing was changed",
                crate::words::cut(group),
                known.join(", ")
            ),
        );
    };
    if g.count == count {
        return ok(json!({
            "generation": view.desired.generation.0,
            "changed": false,
            "message": format!("{group} has {count} node(s) already; nothing to change"),
        }));
    }
    g.count = count;
    shape.generation = Generation(view.desired.generation.0 + 1);
    if !yes {
        let plan = match web.control.cluster.plan(Some(shape.clone())).await {
            Ok(plan) => plan,
            Err(e) => return refuse(StatusCode::BAD_REQUEST, &crate::shapefile::refusal(&e)),
        };
        if let Some(why) = crate::guard::reason_to_ask(&plan.diff) {
            let why = why.replacen("this shape", &format!("scaling {group} to {count}"), 1);
            return (
                StatusCode::CONFLICT,
                axum::Json(json!({
                    "error": format!("{why}: send \"yes\": true to go ahead; nothing was changed"),
                    "confirm": why,
                })),
            )
                .into_response();
        }
    }
    match web.control.cluster.apply(shape).await {
        Ok(DesiredUpdate::Accepted(g) | DesiredUpdate::Unchanged(g)) => {
            let paused = web.control.cluster.glance().await.is_ok_and(|g| g.paused);
            ok(json!({
                "generation": g.0,
                "changed": true,
                "paused": paused,
                "message": format!("{group} scaled to {count}: generation {}", g.0),
            }))
        }
        Err(
            e @ ClusterError::Apply(
                ApplyError::OverCapacity { .. } | ApplyError::Update(UpdateError::Invalid(_)),
            ),
        ) => refuse(StatusCode::BAD_REQUEST, &crate::shapefile::refusal(&e)),
        Err(e @ ClusterError::NotRunning) => {
            refuse(StatusCode::SERVICE_UNAVAILABLE, &web.control.refused(&e))
        }
        Err(e) => refuse(
            StatusCode::CONFLICT,
            &format!(
                "{} (the shape may have changed meanwhile: try again)",
                crate::shapefile::refusal(&e)
            ),
        ),
    }
}
