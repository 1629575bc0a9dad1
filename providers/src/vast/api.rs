//! The Vast.ai REST client: one request at a time per endpoint slot, 429s
//! backed off per endpoint, reads retried, creates never.
//!
//! # Guarantees
//! - The API key goes in the `Authorization` header only, and is redacted
//!   from every error text this module makes (a transport error may quote
//!   a URL or a header).
//! - A create ([`Endpoint::Create`]) is sent at most once per call: only a
//!   429, which the service answers before doing anything, is retried.
//! - A read is retried (up to [`READ_RETRIES_MAX`] times, backing off) on
//!   a 5xx, a lost connection or an answer that is not JSON; a create never.
//! - A 429 delays every later request to the same endpoint (doubling, up to
//!   [`RATE_BACKOFF_CAP`]); nothing retries in a tight loop.

use super::model::{backoff, cut, message_of_text, redact};
use crate::lock;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// First wait after a 429.
pub(crate) const RATE_BACKOFF_BASE: Duration = Duration::from_secs(1);
/// Longest wait after 429s in a row.
pub(crate) const RATE_BACKOFF_CAP: Duration = Duration::from_secs(30);
/// How many times one call retries a 429 before it gives up.
const RATE_RETRIES_MAX: u32 = 4;
/// How many times a read retries a 5xx, a transport failure or an answer
/// that is not JSON.
const READ_RETRIES_MAX: u32 = 3;
/// First wait before a read's retry.
const READ_BACKOFF_BASE: Duration = Duration::from_millis(500);
/// The longest error body read.
const BODY_LEN_MAX: usize = 1 << 20;

/// The service's endpoints, each rate limited on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Endpoint {
    /// `POST /bundles/`.
    Search,
    /// `PUT /asks/{id}/`.
    Create,
    /// Instance listings.
    List,
    /// `GET /instances/{id}/`.
    Show,
    /// `DELETE /instances/{id}/`.
    Destroy,
}

impl Endpoint {
    /// Whether a failed request may be sent again without risk.
    fn is_read(self) -> bool {
        matches!(self, Self::Search | Self::List | Self::Show)
    }
}

/// Least time between two requests to each endpoint (the service's own
/// limits, so that a busy daemon is paced rather than refused).
#[derive(Clone, Debug, PartialEq)]
pub struct Pacing {
    /// Offer searches.
    pub search: Duration,
    /// Creates.
    pub create: Duration,
    /// Listings.
    pub list: Duration,
    /// Shows.
    pub show: Duration,
    /// Destroys.
    pub destroy: Duration,
}

impl Pacing {
    /// The intervals the real service enforces, each a quarter of a second
    /// longer: the service counts from when it accepted the last call, which
    /// is a little after it was sent.
    pub fn service() -> Self {
        Self {
            search: Duration::from_millis(6250),
            create: Duration::from_millis(4750),
            list: Duration::from_millis(1250),
            show: Duration::from_millis(2250),
            destroy: Duration::from_millis(3250),
        }
    }

    /// No pacing at all (a mock with its own limits, tests).
    pub fn none() -> Self {
        Self {
            search: Duration::ZERO,
            create: Duration::ZERO,
            list: Duration::ZERO,
            show: Duration::ZERO,
            destroy: Duration::ZERO,
        }
    }

    fn of(&self, e: Endpoint) -> Duration {
        match e {
            Endpoint::Search => self.search,
            Endpoint::Create => self.create,
            Endpoint::List => self.list,
            Endpoint::Show => self.show,
            Endpoint::Destroy => self.destroy,
        }
    }
}

/// How a request failed.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ApiError {
    /// The service answered with an error status.
    Status {
        /// The HTTP status.
        status: u16,
        /// The body, cut short and redacted.
        body: String,
    },
    /// No connection was made: the request certainly was not seen.
    Unsent(String),
    /// Sent, but no complete answer came back (a timeout, a reset): the
    /// request may have been acted on.
    Lost(String),
    /// A success status with a body that is not JSON.
    Malformed(String),
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Status { status, body } => {
                write!(f, "HTTP {status}: {}", message_of_text(body))
            }
            Self::Unsent(e) => write!(f, "could not reach the service: {e}"),
            Self::Lost(e) => write!(f, "no answer: {e}"),
            Self::Malformed(e) => write!(f, "an answer that is not JSON: {e}"),
        }
    }
}

/// The API key, which never prints.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey([redacted])")
    }
}

impl ApiKey {
    /// A key given as text (surrounding whitespace removed).
    ///
    /// # Errors
    /// The text is empty or holds characters no key has.
    pub fn new(text: &str) -> Result<Self, String> {
        let k = text.trim();
        if k.is_empty() {
            return Err("the Vast.ai API key is empty".to_owned());
        }
        if !k.chars().all(|c| c.is_ascii_graphic()) {
            return Err("the Vast.ai API key holds spaces or non-ASCII characters".to_owned());
        }
        Ok(Self(k.to_owned()))
    }

    /// The key the official client would use: `VAST_API_KEY`, else
    /// `~/.vast_api_key`, else `~/.config/vastai/vast_api_key`.
    ///
    /// # Errors
    /// No key in any of them, in words that name all three.
    pub fn from_env() -> Result<Self, String> {
        Self::find(
            std::env::var(crate::ACCOUNT_ENV[0]).ok().as_deref(),
            std::env::var_os("HOME")
                .map(std::path::PathBuf::from)
                .as_deref(),
        )
    }

    fn find(var: Option<&str>, home: Option<&std::path::Path>) -> Result<Self, String> {
        if let Some(v) = var.filter(|v| !v.trim().is_empty()) {
            return Self::new(v).map_err(|e| format!("VAST_API_KEY: {e}"));
        }
        let files: Vec<std::path::PathBuf> = home
            .map(|h| {
                vec![
                    h.join(".vast_api_key"),
                    h.join(".config/vastai/vast_api_key"),
                ]
            })
            .unwrap_or_default();
        for f in &files {
            if let Ok(text) = std::fs::read_to_string(f)
                && !text.trim().is_empty()
            {
                return Self::new(&text).map_err(|e| format!("{}: {e}", f.display()));
            }
        }
        Err(format!(
            "no Vast.ai API key: set VAST_API_KEY or write the key to {} (as `vastai set api-key` does)",
            files
                .first()
                .map_or_else(|| "~/.vast_api_key".to_owned(), |f| f.display().to_string())
        ))
    }

    pub(crate) fn secret(&self) -> &str {
        &self.0
    }
}

/// Per-endpoint pacing state.
#[derive(Default)]
struct Gate {
    /// No request before this.
    next_at: Option<Instant>,
    /// 429s in a row.
    limited: u32,
}

/// The REST client. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Api {
    http: reqwest::Client,
    /// `{VAST_URL}` without a trailing slash.
    base: String,
    key: ApiKey,
    pacing: Pacing,
    gates: Arc<Mutex<HashMap<Endpoint, Gate>>>,
}

/// A TLS setup on ring with the Mozilla roots (no second crypto library,
/// no system store needed).
fn tls() -> Result<rustls::ClientConfig, String> {
    let roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("cannot set up TLS: {e}"))?
    .with_root_certificates(roots)
    .with_no_client_auth())
}

impl Api {
    /// A client for `base` (e.g. `https://console.vast.ai`).
    pub(crate) fn new(
        base: &str,
        key: ApiKey,
        pacing: Pacing,
        request_timeout: Duration,
    ) -> Result<Self, String> {
        let base = base.trim().trim_end_matches('/').to_owned();
        let url = reqwest::Url::parse(&base).map_err(|e| format!("VAST_URL {base:?}: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") || url.query().is_some() {
            return Err(format!(
                "VAST_URL {base:?} must be an http(s) URL without a query (e.g. https://console.vast.ai)"
            ));
        }
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls()?)
            .connect_timeout(Duration::from_secs(10).min(request_timeout))
            .timeout(request_timeout)
            .user_agent(concat!("swactor/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| {
                format!(
                    "cannot build the HTTP client: {}",
                    redact(&e.to_string(), key.secret())
                )
            })?;
        Ok(Self {
            http,
            base,
            key,
            pacing,
            gates: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    /// The base URL.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// Waits for `e`'s turn and takes it.
    async fn turn(&self, e: Endpoint) {
        let at = {
            let mut gates = lock(&self.gates);
            let gate = gates.entry(e).or_default();
            let now = Instant::now();
            let at = gate.next_at.map_or(now, |t| t.max(now));
            gate.next_at = Some(at + self.pacing.of(e));
            at
        };
        tokio::time::sleep_until(at).await;
    }

    /// Records a 429 on `e`: every later request to it waits.
    fn limited(&self, e: Endpoint) -> Duration {
        let mut gates = lock(&self.gates);
        let gate = gates.entry(e).or_default();
        gate.limited = gate.limited.saturating_add(1);
        let wait = backoff(gate.limited, RATE_BACKOFF_BASE, RATE_BACKOFF_CAP);
        let until = Instant::now() + wait;
        gate.next_at = Some(gate.next_at.map_or(until, |t| t.max(until)));
        tracing::debug!(endpoint = ?e, wait_ms = wait.as_millis() as u64, "rate limited by the service");
        wait
    }

    fn answered(&self, e: Endpoint) {
        if let Some(g) = lock(&self.gates).get_mut(&e) {
            g.limited = 0;
        }
    }

    /// Sends one request under `e`'s rules (see the module docs) and reads
    /// a JSON answer.
    pub(crate) async fn call(
        &self,
        e: Endpoint,
        method: reqwest::Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
    ) -> Result<Value, ApiError> {
        let mut rate_retries = 0;
        let mut read_retries = 0;
        loop {
            self.turn(e).await;
            let result = self.once(method.clone(), path, query, body).await;
            match result {
                Err(ApiError::Status { status: 429, .. }) if rate_retries < RATE_RETRIES_MAX => {
                    rate_retries += 1;
                    self.limited(e);
                }
                Err(err @ ApiError::Status { status: 429, .. }) => {
                    self.limited(e);
                    return Err(err);
                }
                Err(err)
                    if e.is_read()
                        && read_retries < READ_RETRIES_MAX
                        && match &err {
                            ApiError::Status { status, .. } => *status >= 500,
                            // A body cut off mid-JSON is an answer lost on
                            // the way; a read is safe to ask again.
                            ApiError::Unsent(_) | ApiError::Lost(_) | ApiError::Malformed(_) => {
                                true
                            }
                        } =>
                {
                    read_retries += 1;
                    let wait = backoff(read_retries, READ_BACKOFF_BASE, RATE_BACKOFF_CAP);
                    tracing::debug!(endpoint = ?e, error = %err, wait_ms = wait.as_millis() as u64, "retrying a read");
                    tokio::time::sleep(wait).await;
                }
                other => {
                    if other.is_ok() {
                        self.answered(e);
                    }
                    return other;
                }
            }
        }
    }

    async fn once(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
    ) -> Result<Value, ApiError> {
        let secret = self.key.secret();
        let scrub = |e: reqwest::Error| {
            let e = e.without_url();
            let mut text = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                text.push_str(&format!(": {s}"));
                source = s.source();
            }
            cut(&redact(&text, secret))
        };
        let mut url = reqwest::Url::parse(&format!("{}{path}", self.base))
            .map_err(|e| ApiError::Unsent(format!("bad URL for {path}: {e}")))?;
        if !query.is_empty() {
            url.query_pairs_mut()
                .extend_pairs(query.iter().map(|(k, v)| (*k, v.as_str())));
        }
        let mut req = self
            .http
            .request(method, url)
            .bearer_auth(secret)
            .header(reqwest::header::ACCEPT, "application/json");
        if let Some(b) = body {
            req = req
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(b.to_string());
        }
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) if e.is_connect() || e.is_builder() => return Err(ApiError::Unsent(scrub(e))),
            Err(e) => return Err(ApiError::Lost(scrub(e))),
        };
        let status = resp.status().as_u16();
        let bytes = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => {
                return Err(if (200..300).contains(&status) || status >= 500 {
                    ApiError::Lost(scrub(e))
                } else {
                    ApiError::Status {
                        status,
                        body: String::new(),
                    }
                });
            }
        };
        let text = String::from_utf8_lossy(&bytes[..bytes.len().min(BODY_LEN_MAX)]).into_owned();
        let text = redact(&text, secret);
        if !(200..300).contains(&status) {
            return Err(ApiError::Status {
                status,
                body: cut(&text),
            });
        }
        serde_json::from_str(&text).map_err(|e| ApiError::Malformed(format!("{e}: {}", cut(&text))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_read_from_the_variable_then_the_files_and_never_printed() {
        let dir = tempfile::tempdir().unwrap();
        let k = ApiKey::find(Some(" abcdef123456 \n"), Some(dir.path())).unwrap();
        assert_eq!(k.secret(), "abcdef123456");
        assert!(!format!("{k:?}").contains("abcdef"));
        let none = ApiKey::find(None, Some(dir.path())).unwrap_err();
        assert!(
            none.contains("VAST_API_KEY") && none.contains(".vast_api_key"),
            "{none}"
        );
        std::fs::create_dir_all(dir.path().join(".config/vastai")).unwrap();
        std::fs::write(dir.path().join(".config/vastai/vast_api_key"), "older\n").unwrap();
        assert_eq!(
            ApiKey::find(None, Some(dir.path())).unwrap().secret(),
            "older"
        );
        std::fs::write(dir.path().join(".vast_api_key"), "newer\n").unwrap();
        assert_eq!(
            ApiKey::find(Some(""), Some(dir.path())).unwrap().secret(),
            "newer"
        );
        assert!(ApiKey::new("two words").is_err());
    }

    #[test]
    fn a_bad_base_url_is_refused_before_any_request() {
        let key = ApiKey::new("k1234567").unwrap();
        assert!(
            Api::new(
                "ftp://x",
                key.clone(),
                Pacing::none(),
                Duration::from_secs(1)
            )
            .is_err()
        );
        assert!(
            Api::new(
                "not a url",
                key.clone(),
                Pacing::none(),
                Duration::from_secs(1)
            )
            .is_err()
        );
        let api = Api::new(
            "http://127.0.0.1:9/",
            key,
            Pacing::none(),
            Duration::from_secs(1),
        )
        .unwrap();
        assert_eq!(api.base(), "http://127.0.0.1:9");
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_delays_the_next_request_to_that_endpoint_only_and_doubles() {
        let api = Api::new(
            "http://127.0.0.1:9",
            ApiKey::new("k1234567").unwrap(),
            Pacing::none(),
            Duration::from_secs(1),
        )
        .unwrap();
        assert_eq!(api.limited(Endpoint::Create), Duration::from_secs(1));
        assert_eq!(api.limited(Endpoint::Create), Duration::from_secs(2));
        let start = Instant::now();
        api.turn(Endpoint::Show).await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        api.turn(Endpoint::Create).await;
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        api.answered(Endpoint::Create);
        assert_eq!(api.limited(Endpoint::Create), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn pacing_spaces_requests_to_one_endpoint() {
        let api = Api::new(
            "http://127.0.0.1:9",
            ApiKey::new("k1234567").unwrap(),
            Pacing::service(),
            Duration::from_secs(1),
        )
        .unwrap();
        let start = Instant::now();
        for _ in 0..3 {
            api.turn(Endpoint::Create).await;
        }
        assert_eq!(start.elapsed(), Duration::from_millis(9500));
    }
}
