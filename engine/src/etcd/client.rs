//! An etcd v3 client over the JSON gateway every etcd member serves
//! (`POST /v3/kv/range` and friends): several members, bounded calls,
//! optional TLS and authentication.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::EtcdError;
use super::config::{Credentials, EtcdConfig, rustls_config, unused_tls};
use super::wire::{self, b64};

/// Largest answer the client reads, in bytes; a range is paged well below it.
pub const RESPONSE_LEN_MAX_BYTES: usize = 64 << 20;
/// The first pause after every member failed, doubled up to [`ROUND_PAUSE_MAX`].
const ROUND_PAUSE_MIN: Duration = Duration::from_millis(50);
const ROUND_PAUSE_MAX: Duration = Duration::from_millis(500);

/// gRPC status codes etcd answers with that the client decides on.
const CODE_RESOURCE_EXHAUSTED: i32 = 8;
const CODE_UNAVAILABLE: i32 = 14;
const CODE_UNAUTHENTICATED: i32 = 16;

/// A client of one etcd cluster; cheap to clone, and clones share connections.
///
/// # Guarantees
/// - Every call ends by the configuration's `call_timeout`, and one request
///   to one member by its `request_timeout`: a dead or frozen member costs
///   at most that before the next one is tried.
/// - A member that cannot be connected to (nothing was sent) is skipped for
///   the next. Reads are also sent again elsewhere after no answer; a write
///   is not (the caller gets [`EtcdError::NoAnswer`]: it may have landed),
///   except transactions the caller made safe to resend
///   ([`Client::txn_resendable`]).
/// - No error holds a password, token or value (see [`EtcdError`]).
#[derive(Clone, Debug)]
pub struct Client {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    http: reqwest::Client,
    config: EtcdConfig,
    /// The endpoints without a trailing slash.
    bases: Vec<String>,
    /// The member that answered last, tried first.
    preferred: AtomicUsize,
    /// The authentication token, once one was obtained.
    token: Mutex<Option<Arc<str>>>,
}

/// One key and its revisions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: Vec<u8>,
    /// Its value.
    pub value: Vec<u8>,
    /// The revision that created it (it stays until the key is deleted).
    pub create_revision: i64,
    /// The revision that last wrote it.
    pub mod_revision: i64,
    /// How many times it was written since it was created.
    pub version: i64,
    /// The lease it is attached to (0: none).
    pub lease: i64,
}

/// Which keys a range reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Range {
    /// The first key.
    pub key: Vec<u8>,
    /// The end (exclusive); `None` reads `key` alone.
    pub end: Option<Vec<u8>>,
    /// Most keys to return (0: all).
    pub limit: i64,
    /// The revision to read at (0: the newest).
    pub revision: i64,
}

impl Range {
    /// One key.
    pub fn key(key: impl Into<Vec<u8>>) -> Self {
        Self {
            key: key.into(),
            ..Self::default()
        }
    }

    /// Every key starting with `prefix`.
    pub fn prefix(prefix: impl Into<Vec<u8>>) -> Self {
        let key = prefix.into();
        let end = prefix_end(&key);
        Self {
            key,
            end: Some(end),
            ..Self::default()
        }
    }
}

/// The first key after every key starting with `prefix` (etcd's `range_end`).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte was 0xff (or none was given): to the end of the key space.
    vec![0]
}

/// A page of a range.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangePage {
    /// The keys, in key order.
    pub kvs: Vec<KeyValue>,
    /// Whether more keys matched than `limit` allowed.
    pub more: bool,
    /// How many keys matched in all.
    pub count: i64,
    /// The revision the page was read at.
    pub revision: i64,
}

/// Which of a key's properties a comparison looks at, and the value it must have.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// The revision that created the key (0: the key does not exist).
    CreateRevision(i64),
    /// The revision that last wrote the key (0: the key does not exist).
    ModRevision(i64),
    /// How many times the key was written (0: the key does not exist).
    Version(i64),
    /// The key's value (false when the key does not exist).
    Value(Vec<u8>),
}

/// How a key's property must relate to the comparison's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Relation {
    /// Equal to it.
    Equal,
    /// Not equal to it.
    NotEqual,
    /// Less than it.
    Less,
    /// Greater than it.
    Greater,
}

/// One comparison of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compare {
    /// The key compared.
    pub key: Vec<u8>,
    /// What must hold.
    pub relation: Relation,
    /// What is compared.
    pub target: Target,
}

impl Compare {
    /// `key` was created at `revision` (0: `key` does not exist).
    pub fn created_at(key: impl Into<Vec<u8>>, revision: i64) -> Self {
        Self {
            key: key.into(),
            relation: Relation::Equal,
            target: Target::CreateRevision(revision),
        }
    }

    /// `key` was last written at `revision` (0: `key` does not exist).
    pub fn modified_at(key: impl Into<Vec<u8>>, revision: i64) -> Self {
        Self {
            key: key.into(),
            relation: Relation::Equal,
            target: Target::ModRevision(revision),
        }
    }

    /// `key` holds `value`.
    pub fn value_is(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Self {
        Self {
            key: key.into(),
            relation: Relation::Equal,
            target: Target::Value(value.into()),
        }
    }
}

/// One operation of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Write `value` at `key`, attached to `lease` (0: none).
    Put {
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
        /// The lease (0: none).
        lease: i64,
    },
    /// Delete `key`, or every key from `key` to `end` (exclusive).
    Delete {
        /// The key, or the first key.
        key: Vec<u8>,
        /// The end of the range (`None`: `key` alone).
        end: Option<Vec<u8>>,
    },
    /// Read keys.
    Get(Range),
}

/// An etcd transaction: if every comparison holds, `success` runs, else
/// `failure`; either as one atomic step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Txn {
    /// All must hold for `success` to run.
    pub compare: Vec<Compare>,
    /// Run when every comparison holds.
    pub success: Vec<Op>,
    /// Run otherwise.
    pub failure: Vec<Op>,
}

/// What one operation of a transaction answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpResponse {
    /// A put.
    Put,
    /// A delete, with how many keys it removed.
    Delete(u64),
    /// A read.
    Get(RangePage),
}

/// What a transaction did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxnResponse {
    /// Whether the comparisons held (and `success` ran).
    pub succeeded: bool,
    /// The revision after the transaction (its own, if it wrote anything).
    pub revision: i64,
    /// One answer per operation of the branch that ran.
    pub responses: Vec<OpResponse>,
}

impl TxnResponse {
    /// The response of a transaction whose comparisons held, or
    /// [`EtcdError::CompareFailed`]: for callers to whom a failed
    /// comparison is a failure (a create-if-absent that lost).
    ///
    /// # Errors
    /// [`EtcdError::CompareFailed`] when `succeeded` is false.
    pub fn check(self) -> Result<Self, EtcdError> {
        if self.succeeded {
            Ok(self)
        } else {
            Err(EtcdError::CompareFailed {
                revision: self.revision,
            })
        }
    }
}

/// A lease: keys attached to it are deleted when it expires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// Its id.
    pub id: i64,
    /// Its time to live as granted, in seconds.
    pub ttl_s: i64,
}

/// Whether a request may be sent again to another member after it may
/// have reached one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resend {
    /// Yes: it has no effect, or the same effect twice.
    Safe,
    /// Only when it certainly reached no member.
    Never,
}

/// How one request to one member failed.
enum Attempt {
    /// Nothing was sent (no connection).
    NotSent(String),
    /// Sent, and no usable answer: it may have had an effect.
    Unknown(String),
    /// The token is no longer valid.
    Unauthenticated,
    /// An answer that ends the call.
    Final(EtcdError),
}

impl Client {
    /// A client for `config`; connects lazily, on the first call.
    ///
    /// # Errors
    /// [`EtcdError::Config`] when the configuration does not validate,
    /// [`EtcdError::Tls`] when a TLS file cannot be used.
    pub fn new(config: EtcdConfig) -> Result<Self, EtcdError> {
        config.validate()?;
        let mut builder = reqwest::Client::builder()
            // etcd is dialled directly, never through a proxy from the environment.
            .no_proxy()
            .connect_timeout(config.request_timeout)
            .pool_idle_timeout(Duration::from_secs(30))
            .user_agent(concat!("swactor/", env!("CARGO_PKG_VERSION")));
        builder = builder.tls_backend_preconfigured(match &config.tls {
            Some(files) => rustls_config(files)?,
            None => unused_tls()?,
        });
        let http = builder
            .build()
            .map_err(|e| EtcdError::Config(format!("cannot build the HTTP client: {e}")))?;
        let bases = config
            .endpoints
            .iter()
            .map(|e| e.trim_end_matches('/').to_owned())
            .collect();
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                config,
                bases,
                preferred: AtomicUsize::new(0),
                token: Mutex::new(None),
            }),
        })
    }

    /// The configuration it was made with.
    #[must_use]
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// One key, if it exists.
    ///
    /// # Errors
    /// See [`EtcdError`].
    pub async fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<KeyValue>, EtcdError> {
        let page = self.range(&Range::key(key.as_ref())).await?;
        Ok(page.kvs.into_iter().next())
    }

    /// A page of keys.
    ///
    /// # Errors
    /// See [`EtcdError`].
    pub async fn range(&self, range: &Range) -> Result<RangePage, EtcdError> {
        let (_, body): (_, wire::RangeBody) = self
            .call("/v3/kv/range", &range_json(range), Resend::Safe)
            .await?;
        Ok(page(body))
    }

    /// Writes `value` at `key` (attached to `lease`, if any); returns the write's revision.
    ///
    /// # Errors
    /// See [`EtcdError`]; [`EtcdError::NoAnswer`] when it may have landed.
    pub async fn put(
        &self,
        key: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
        lease: Option<i64>,
    ) -> Result<i64, EtcdError> {
        let body = put_json(key.as_ref(), value.as_ref(), lease.unwrap_or(0));
        let (_, answer): (_, wire::PutBody) = self.call("/v3/kv/put", &body, Resend::Never).await?;
        Ok(answer.header.revision)
    }

    /// Deletes every key starting with `prefix` (the key `prefix` itself
    /// when `whole_prefix` is false); returns how many it deleted.
    ///
    /// # Errors
    /// See [`EtcdError`]; [`EtcdError::NoAnswer`] when it may have landed.
    pub async fn delete(
        &self,
        prefix: impl AsRef<[u8]>,
        whole_prefix: bool,
    ) -> Result<u64, EtcdError> {
        let key = prefix.as_ref();
        let end = whole_prefix.then(|| prefix_end(key));
        let body = delete_json(key, end.as_deref());
        let (_, answer): (_, wire::DeleteBody) = self
            .call("/v3/kv/deleterange", &body, Resend::Never)
            .await?;
        Ok(u64::try_from(answer.deleted).unwrap_or(0))
    }

    /// Runs a transaction once.
    ///
    /// # Errors
    /// See [`EtcdError`]; [`EtcdError::NoAnswer`] when it may have landed.
    /// A comparison that did not hold is not an error (`succeeded` is false).
    pub async fn txn(&self, txn: &Txn) -> Result<TxnResponse, EtcdError> {
        self.txn_with(txn, Resend::Never).await
    }

    /// Runs a transaction that the caller made safe to run twice (its
    /// comparisons fail once it landed, and the caller can tell its own
    /// landed write from another's by the failure branch's reads): sent
    /// again to another member after no answer, until the call's deadline.
    ///
    /// # Errors
    /// As [`Client::txn`].
    pub async fn txn_resendable(&self, txn: &Txn) -> Result<TxnResponse, EtcdError> {
        self.txn_with(txn, Resend::Safe).await
    }

    async fn txn_with(&self, txn: &Txn, resend: Resend) -> Result<TxnResponse, EtcdError> {
        let (_, body): (_, wire::TxnBody) = self.call("/v3/kv/txn", &txn_json(txn), resend).await?;
        let mut responses = Vec::with_capacity(body.responses.len());
        for op in body.responses {
            responses.push(if let Some(range) = op.response_range {
                OpResponse::Get(page(range))
            } else if let Some(delete) = op.response_delete_range {
                OpResponse::Delete(u64::try_from(delete.deleted).unwrap_or(0))
            } else {
                OpResponse::Put
            });
        }
        Ok(TxnResponse {
            succeeded: body.succeeded,
            revision: body.header.revision,
            responses,
        })
    }

    /// Grants a lease of `ttl_s` seconds.
    ///
    /// # Errors
    /// See [`EtcdError`].
    pub async fn lease_grant(&self, ttl_s: i64) -> Result<Lease, EtcdError> {
        let body = json!({ "TTL": ttl_s.to_string() });
        let (endpoint, answer): (_, wire::LeaseBody) =
            self.call("/v3/lease/grant", &body, Resend::Never).await?;
        if !answer.error.is_empty() || answer.id == 0 {
            return Err(EtcdError::Refused {
                endpoint,
                code: 0,
                message: format!("no lease was granted: {}", answer.error),
            });
        }
        Ok(Lease {
            id: answer.id,
            ttl_s: answer.ttl,
        })
    }

    /// Renews a lease once; returns its new time to live, or `None` when
    /// the lease no longer exists (it expired or was revoked).
    ///
    /// # Errors
    /// See [`EtcdError`].
    pub async fn lease_keep_alive(&self, id: i64) -> Result<Option<i64>, EtcdError> {
        let body = json!({ "ID": id.to_string() });
        let (endpoint, answer): (_, wire::StreamBody<wire::LeaseBody>) = self
            .call("/v3/lease/keepalive", &body, Resend::Safe)
            .await?;
        match (answer.result, answer.error) {
            (Some(lease), _) => Ok((lease.ttl > 0).then_some(lease.ttl)),
            (None, error) => Err(EtcdError::Decode {
                endpoint,
                what: format!("a keep-alive without a result ({error:?})"),
            }),
        }
    }

    /// How long a lease has left, in seconds; `None` when it no longer exists.
    ///
    /// # Errors
    /// See [`EtcdError`].
    pub async fn lease_time_to_live(&self, id: i64) -> Result<Option<i64>, EtcdError> {
        let body = json!({ "ID": id.to_string() });
        let (_, answer): (_, wire::LeaseBody) = self
            .call("/v3/lease/timetolive", &body, Resend::Safe)
            .await?;
        Ok((answer.ttl >= 0).then_some(answer.ttl))
    }

    /// Revokes a lease, deleting every key attached to it.
    ///
    /// # Errors
    /// See [`EtcdError`].
    pub async fn lease_revoke(&self, id: i64) -> Result<(), EtcdError> {
        let body = json!({ "ID": id.to_string() });
        let (_, _answer): (_, wire::PutBody) =
            self.call("/v3/lease/revoke", &body, Resend::Never).await?;
        Ok(())
    }

    /// Sends `body` to `path`, moving through the members until one answers
    /// or the call's deadline passes.
    async fn call<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &Value,
        resend: Resend,
    ) -> Result<(String, T), EtcdError> {
        let deadline = Instant::now() + self.inner.config.call_timeout;
        let body = serde_json::to_vec(body).map_err(|e| EtcdError::Config(e.to_string()))?;
        let mut tried = Vec::new();
        let mut sent = false;
        let mut pause = ROUND_PAUSE_MIN;
        let n = self.inner.bases.len();
        loop {
            let first = self.inner.preferred.load(Ordering::Relaxed) % n;
            for member in (first..n).chain(0..first) {
                if deadline <= Instant::now() {
                    return Err(self.gave_up(tried, sent));
                }
                let endpoint = self.inner.bases[member].clone();
                match self.attempt_logged_in(member, path, &body, deadline).await {
                    Ok(bytes) => {
                        self.inner.preferred.store(member, Ordering::Relaxed);
                        return decode(&endpoint, &bytes).map(|t| (endpoint, t));
                    }
                    Err(Attempt::NotSent(why)) => tried.push((endpoint, why)),
                    Err(Attempt::Unknown(why)) => {
                        tried.push((endpoint, why));
                        sent = true;
                        if resend == Resend::Never {
                            return Err(self.gave_up(tried, true));
                        }
                    }
                    Err(Attempt::Unauthenticated) => {
                        return Err(EtcdError::Auth {
                            endpoint,
                            user: self.user(),
                            message: "the token etcd had just given was refused".to_owned(),
                        });
                    }
                    Err(Attempt::Final(e)) => return Err(e),
                }
            }
            // Every member failed: give an election or a restart a moment.
            let rest = deadline.saturating_duration_since(Instant::now());
            tokio::time::sleep(pause.min(rest)).await;
            pause = (pause * 2).min(ROUND_PAUSE_MAX);
        }
    }

    fn gave_up(&self, tried: Vec<(String, String)>, sent: bool) -> EtcdError {
        let after_ms =
            u64::try_from(self.inner.config.call_timeout.as_millis()).unwrap_or(u64::MAX);
        if sent {
            EtcdError::NoAnswer { tried, after_ms }
        } else {
            EtcdError::Unreachable { tried, after_ms }
        }
    }

    /// [`Self::attempt`], logged in first when the cluster wants
    /// credentials, and once more when the token has expired.
    async fn attempt_logged_in(
        &self,
        member: usize,
        path: &str,
        body: &[u8],
        deadline: Instant,
    ) -> Result<Vec<u8>, Attempt> {
        if self.inner.config.auth.is_none() {
            return self.attempt(member, path, body, deadline).await;
        }
        if self.token().is_none() {
            self.authenticate(member, deadline).await?;
        }
        match self.attempt(member, path, body, deadline).await {
            Err(Attempt::Unauthenticated) => {
                self.clear_token();
                self.authenticate(member, deadline).await?;
                self.attempt(member, path, body, deadline).await
            }
            other => other,
        }
    }

    /// One request to one member, bounded by the request timeout and the deadline.
    async fn attempt(
        &self,
        member: usize,
        path: &str,
        body: &[u8],
        deadline: Instant,
    ) -> Result<Vec<u8>, Attempt> {
        let endpoint = &self.inner.bases[member];
        let timeout = self
            .inner
            .config
            .request_timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        let mut request = self
            .inner
            .http
            .post(format!("{endpoint}{path}"))
            .timeout(timeout)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_vec());
        if let Some(token) = self.token().filter(|_| path != AUTH_PATH) {
            request = request.header(reqwest::header::AUTHORIZATION, &*token);
        }
        let timeout_ms = timeout.as_millis();
        let mut response = request.send().await.map_err(|e| classify(&e, timeout_ms))?;
        let status = response.status();
        let mut bytes = Vec::new();
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) if bytes.len() + chunk.len() > RESPONSE_LEN_MAX_BYTES => {
                    return Err(Attempt::Final(EtcdError::Decode {
                        endpoint: endpoint.clone(),
                        what: format!("an answer longer than {RESPONSE_LEN_MAX_BYTES} bytes"),
                    }));
                }
                Ok(Some(chunk)) => bytes.extend_from_slice(&chunk),
                Ok(None) => break,
                Err(e) => return Err(Attempt::Unknown(reason(&e, timeout_ms))),
            }
        }
        if status.is_success() {
            return Ok(bytes);
        }
        Err(self.answered_error(endpoint, status, &bytes))
    }

    /// What an error answer means for the call.
    fn answered_error(&self, endpoint: &str, status: reqwest::StatusCode, bytes: &[u8]) -> Attempt {
        let Ok(body) = serde_json::from_slice::<wire::ErrorBody>(bytes) else {
            // Not the gateway (a proxy, another server): nothing was done.
            return Attempt::Final(EtcdError::Refused {
                endpoint: endpoint.to_owned(),
                code: 0,
                message: format!("HTTP {status} without an etcd error"),
            });
        };
        let message = if body.message.is_empty() {
            body.error
        } else {
            body.message
        };
        match body.code {
            CODE_UNAVAILABLE => Attempt::Unknown(message),
            CODE_UNAUTHENTICATED if self.inner.config.auth.is_some() => Attempt::Unauthenticated,
            _ => Attempt::Final(refusal(endpoint, body.code, message)),
        }
    }

    fn token(&self) -> Option<Arc<str>> {
        self.inner
            .token
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn clear_token(&self) {
        *self
            .inner
            .token
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
    }

    fn user(&self) -> String {
        self.inner
            .config
            .auth
            .as_ref()
            .map(|c| c.user.clone())
            .unwrap_or_default()
    }

    /// Logs in at `member` with the configured credentials and keeps the token.
    async fn authenticate(&self, member: usize, deadline: Instant) -> Result<(), Attempt> {
        let Some(credentials) = &self.inner.config.auth else {
            return Ok(());
        };
        let endpoint = &self.inner.bases[member];
        let refused = |message: String| {
            Attempt::Final(EtcdError::Auth {
                endpoint: endpoint.clone(),
                user: credentials.user.clone(),
                message,
            })
        };
        let bytes = match self
            .attempt(member, AUTH_PATH, &auth_json(credentials), deadline)
            .await
        {
            Ok(bytes) => bytes,
            Err(Attempt::Final(EtcdError::Refused { message, .. })) => {
                return Err(refused(message));
            }
            Err(Attempt::Unauthenticated) => return Err(refused("etcd refused to log in".into())),
            // The request itself was not sent: the call may move on.
            Err(Attempt::NotSent(why) | Attempt::Unknown(why)) => {
                return Err(Attempt::NotSent(format!("logging in: {why}")));
            }
            Err(other) => return Err(other),
        };
        let answer: wire::AuthBody = decode(endpoint, &bytes).map_err(Attempt::Final)?;
        if answer.token.is_empty() {
            // Authentication is off: etcd gives no token, and needs none.
            return Ok(());
        }
        *self
            .inner
            .token
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Arc::from(answer.token));
        Ok(())
    }
}

const AUTH_PATH: &str = "/v3/auth/authenticate";

fn auth_json(credentials: &Credentials) -> Vec<u8> {
    serde_json::to_vec(&wire::AuthRequest {
        name: &credentials.user,
        password: credentials.password(),
    })
    .unwrap_or_default()
}

/// A transport failure: was anything sent?
fn classify(e: &reqwest::Error, timeout_ms: u128) -> Attempt {
    // A TLS failure (under TLS 1.3 a refused client certificate shows only
    // once the request is written) means no member read the request.
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    let tls = std::iter::from_fn(|| {
        let this = source?;
        source = this.source();
        Some(this)
    })
    .any(|s| {
        // An `io::Error` hides the error it wraps from the chain of sources.
        let inner = s
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref());
        s.is::<rustls::Error>() || inner.is_some_and(|i| i.is::<rustls::Error>())
    });
    if e.is_connect() || tls {
        Attempt::NotSent(reason(e, timeout_ms))
    } else {
        Attempt::Unknown(reason(e, timeout_ms))
    }
}

/// A transport failure in a few words: its root cause (no URL, which the caller names).
fn reason(e: &reqwest::Error, timeout_ms: u128) -> String {
    if e.is_timeout() {
        return format!("no answer within {timeout_ms} ms");
    }
    let mut root: &dyn std::error::Error = e;
    while let Some(source) = root.source() {
        root = source;
    }
    let words = root.to_string();
    if e.is_connect() {
        format!("cannot connect: {words}")
    } else {
        words
    }
}

/// An error etcd answered, typed by what the caller can do about it.
fn refusal(endpoint: &str, code: i32, message: String) -> EtcdError {
    let too_large = |setting| EtcdError::TooLarge {
        what: format!("the request ({message})"),
        setting,
    };
    if message.contains("too many operations in txn request") {
        too_large("--max-txn-ops")
    } else if message.contains("request is too large")
        || (code == CODE_RESOURCE_EXHAUSTED && message.contains("larger than max"))
    {
        too_large("--max-request-bytes")
    } else {
        EtcdError::Refused {
            endpoint: endpoint.to_owned(),
            code,
            message,
        }
    }
}

fn decode<T: DeserializeOwned>(endpoint: &str, bytes: &[u8]) -> Result<T, EtcdError> {
    serde_json::from_slice(bytes).map_err(|e| EtcdError::Decode {
        endpoint: endpoint.to_owned(),
        what: e.to_string(),
    })
}

fn page(body: wire::RangeBody) -> RangePage {
    RangePage {
        kvs: body
            .kvs
            .into_iter()
            .map(|kv| KeyValue {
                key: kv.key,
                value: kv.value,
                create_revision: kv.create_revision,
                mod_revision: kv.mod_revision,
                version: kv.version,
                lease: kv.lease,
            })
            .collect(),
        more: body.more,
        count: body.count,
        revision: body.header.revision,
    }
}

fn range_json(range: &Range) -> Value {
    let mut body = json!({ "key": b64(&range.key) });
    if let Some(end) = &range.end {
        body["range_end"] = json!(b64(end));
    }
    if range.limit > 0 {
        body["limit"] = json!(range.limit.to_string());
    }
    if range.revision > 0 {
        body["revision"] = json!(range.revision.to_string());
    }
    body
}

fn put_json(key: &[u8], value: &[u8], lease: i64) -> Value {
    let mut body = json!({ "key": b64(key), "value": b64(value) });
    if lease != 0 {
        body["lease"] = json!(lease.to_string());
    }
    body
}

fn delete_json(key: &[u8], end: Option<&[u8]>) -> Value {
    let mut body = json!({ "key": b64(key) });
    if let Some(end) = end {
        body["range_end"] = json!(b64(end));
    }
    body
}

fn compare_json(c: &Compare) -> Value {
    let result = match c.relation {
        Relation::Equal => "EQUAL",
        Relation::NotEqual => "NOT_EQUAL",
        Relation::Less => "LESS",
        Relation::Greater => "GREATER",
    };
    let mut body = json!({ "key": b64(&c.key), "result": result });
    match &c.target {
        Target::CreateRevision(r) => {
            body["target"] = json!("CREATE");
            body["create_revision"] = json!(r.to_string());
        }
        Target::ModRevision(r) => {
            body["target"] = json!("MOD");
            body["mod_revision"] = json!(r.to_string());
        }
        Target::Version(v) => {
            body["target"] = json!("VERSION");
            body["version"] = json!(v.to_string());
        }
        Target::Value(v) => {
            body["target"] = json!("VALUE");
            body["value"] = json!(b64(v));
        }
    }
    body
}

fn op_json(op: &Op) -> Value {
    match op {
        Op::Put { key, value, lease } => json!({ "request_put": put_json(key, value, *lease) }),
        Op::Delete { key, end } => {
            json!({ "request_delete_range": delete_json(key, end.as_deref()) })
        }
        Op::Get(range) => json!({ "request_range": range_json(range) }),
    }
}

fn txn_json(txn: &Txn) -> Value {
    json!({
        "compare": txn.compare.iter().map(compare_json).collect::<Vec<_>>(),
        "success": txn.success.iter().map(op_json).collect::<Vec<_>>(),
        "failure": txn.failure.iter().map(op_json).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_at_the_next_key_that_does_not_start_with_it() {
        assert_eq!(prefix_end(b"a/b"), b"a/c");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
        assert_eq!(prefix_end(b""), b"\0");
    }

    #[test]
    fn a_transaction_is_written_as_the_gateway_reads_it() {
        let txn = Txn {
            compare: vec![Compare::created_at("k", 7)],
            success: vec![Op::Put {
                key: b"k".to_vec(),
                value: b"v".to_vec(),
                lease: 0,
            }],
            failure: vec![Op::Get(Range::key("k"))],
        };
        assert_eq!(
            txn_json(&txn),
            json!({
                "compare": [{"key": "aw==", "result": "EQUAL", "target": "CREATE", "create_revision": "7"}],
                "success": [{"request_put": {"key": "aw==", "value": "dg=="}}],
                "failure": [{"request_range": {"key": "aw=="}}],
            })
        );
    }

    #[test]
    fn etcds_limits_are_named_by_the_setting_that_raises_them() {
        let e = refusal(
            "http://h:1",
            3,
            "etcdserver: too many operations in txn request".into(),
        );
        assert!(
            matches!(
                e,
                EtcdError::TooLarge {
                    setting: "--max-txn-ops",
                    ..
                }
            ),
            "{e}"
        );
        let e = refusal("http://h:1", 3, "etcdserver: request is too large".into());
        assert!(
            matches!(
                e,
                EtcdError::TooLarge {
                    setting: "--max-request-bytes",
                    ..
                }
            ),
            "{e}"
        );
        let e = refusal("http://h:1", 7, "etcdserver: permission denied".into());
        assert!(matches!(e, EtcdError::Refused { code: 7, .. }), "{e}");
    }
}
