//! Where an etcd cluster is and how to reach it: endpoints, timeouts, TLS files, credentials.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::EtcdError;

/// The environment variables [`EtcdConfig::from_sources`] falls back to,
/// the ones `etcdctl` reads.
pub const ENDPOINTS_ENV: &str = "ETCDCTL_ENDPOINTS";
/// The CA file `etcdctl` trusts.
pub const CACERT_ENV: &str = "ETCDCTL_CACERT";
/// The client certificate `etcdctl` presents.
pub const CERT_ENV: &str = "ETCDCTL_CERT";
/// The client certificate's private key.
pub const KEY_ENV: &str = "ETCDCTL_KEY";
/// `user` or `user:password`, as `etcdctl --user` takes it.
pub const USER_ENV: &str = "ETCDCTL_USER";
/// The password, when [`USER_ENV`] holds only the user.
pub const PASSWORD_ENV: &str = "ETCDCTL_PASSWORD";

/// How long one request to one member may take by default.
pub const REQUEST_TIMEOUT_DEFAULT: Duration = Duration::from_secs(2);
/// How long one call (every member it tries, every retry) may take by default.
pub const CALL_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);
/// Most endpoints one configuration may name.
pub const ENDPOINTS_MAX: usize = 16;

/// How to reach an etcd cluster. Build it with [`EtcdConfig::new`] or
/// [`EtcdConfig::from_sources`], then check it with [`EtcdConfig::validate`]
/// (the client does).
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// The members' client URLs (`http://127.0.0.1:2379`), tried in order;
    /// a call moves to the next one when a member cannot be reached.
    pub endpoints: Vec<String>,
    /// The longest one request to one member may take (a member that does
    /// not answer costs at most this before the next is tried).
    pub request_timeout: Duration,
    /// The longest one call may take, retries and all: every call ends,
    /// answered or failed, by then.
    pub call_timeout: Duration,
    /// Files for `https` endpoints; `None` for `http`.
    pub tls: Option<TlsFiles>,
    /// Credentials for a cluster with authentication on.
    pub auth: Option<Credentials>,
}

/// The PEM files of a TLS setup: the CA that signed the members'
/// certificates, and optionally this client's certificate and key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The CA certificate(s) the members' certificates must chain to.
    pub ca: PathBuf,
    /// This client's certificate chain, for members that ask for one.
    pub cert: Option<PathBuf>,
    /// The private key of `cert`.
    pub key: Option<PathBuf>,
}

/// A user and password for etcd's authentication. The password is never
/// printed: not by `Debug`, not in any error.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The etcd user.
    pub user: String,
    password: String,
}

impl Credentials {
    /// A user and its password.
    pub fn new(user: impl Into<String>, password: impl Into<String>) -> Self {
        Self {
            user: user.into(),
            password: password.into(),
        }
    }

    /// Parses `user:password` (or `user` with the password given apart), as
    /// `etcdctl --user` and `--password` take them.
    pub fn parse(user: &str, password: Option<&str>) -> Self {
        match (user.split_once(':'), password) {
            (_, Some(p)) => Self::new(user, p),
            (Some((u, p)), None) => Self::new(u, p),
            (None, None) => Self::new(user, ""),
        }
    }

    pub(crate) fn password(&self) -> &str {
        &self.password
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .field("password", &"<hidden>")
            .finish()
    }
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("request_timeout", &self.request_timeout)
            .field("call_timeout", &self.call_timeout)
            .field("tls", &self.tls)
            .field("auth", &self.auth)
            .finish()
    }
}

/// What a command line said about etcd, before the environment fills the gaps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdFlags {
    /// `--etcd URL[,URL…]`.
    pub endpoints: Option<String>,
    /// `--etcd-cacert FILE`.
    pub cacert: Option<PathBuf>,
    /// `--etcd-cert FILE`.
    pub cert: Option<PathBuf>,
    /// `--etcd-key FILE`.
    pub key: Option<PathBuf>,
}

impl EtcdConfig {
    /// Plain `http` endpoints with the default timeouts, no TLS, no credentials.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            request_timeout: REQUEST_TIMEOUT_DEFAULT,
            call_timeout: CALL_TIMEOUT_DEFAULT,
            tls: None,
            auth: None,
        }
    }

    /// Builds a configuration from flags, each absent one taken from the
    /// environment as `etcdctl` would (`ETCDCTL_ENDPOINTS`, `ETCDCTL_CACERT`,
    /// `ETCDCTL_CERT`, `ETCDCTL_KEY`; credentials only from `ETCDCTL_USER`
    /// and `ETCDCTL_PASSWORD`, so they never show in a process list).
    /// `env` reads one variable (`|n| std::env::var(n).ok()` in a program).
    /// `Ok(None)` when neither names any endpoint.
    ///
    /// # Errors
    /// [`EtcdError::Config`] when the result does not [validate](Self::validate).
    pub fn from_sources(
        flags: &EtcdFlags,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, EtcdError> {
        let var = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        let Some(endpoints) = flags.endpoints.clone().or_else(|| var(ENDPOINTS_ENV)) else {
            return Ok(None);
        };
        let path = |flag: &Option<PathBuf>, name: &str| {
            flag.clone().or_else(|| var(name).map(PathBuf::from))
        };
        let ca = path(&flags.cacert, CACERT_ENV);
        let cert = path(&flags.cert, CERT_ENV);
        let key = path(&flags.key, KEY_ENV);
        let mut config = Self::new(
            endpoints
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .map(str::to_owned),
        );
        config.tls = match (ca, cert, key) {
            (None, None, None) => None,
            (Some(ca), cert, key) => Some(TlsFiles { ca, cert, key }),
            (None, _, _) => {
                return Err(EtcdError::Config(
                    "a client certificate or key was given without a CA file \
                     (--etcd-cacert or ETCDCTL_CACERT)"
                        .to_owned(),
                ));
            }
        };
        config.auth = var(USER_ENV).map(|u| Credentials::parse(&u, var(PASSWORD_ENV).as_deref()));
        config.validate()?;
        Ok(Some(config))
    }

    /// Checks that the configuration can be used.
    ///
    /// # Errors
    /// [`EtcdError::Config`], naming what is wrong: no endpoint or too many,
    /// an endpoint that is not a plain `http(s)://host:port` URL (no user
    /// information, path or query: a secret in a URL would end up in
    /// errors and logs), endpoints of mixed schemes, `https` without a CA
    /// file or `http` with one, a certificate without its key, or a zero
    /// timeout.
    pub fn validate(&self) -> Result<(), EtcdError> {
        let bad = |what: String| Err(EtcdError::Config(what));
        if self.endpoints.is_empty() {
            return bad("no etcd endpoint was given".to_owned());
        }
        if self.endpoints.len() > ENDPOINTS_MAX {
            return bad(format!(
                "{} etcd endpoints were given; at most {ENDPOINTS_MAX} are allowed",
                self.endpoints.len()
            ));
        }
        let mut schemes = Vec::new();
        for endpoint in &self.endpoints {
            schemes.push(endpoint_scheme(endpoint)?);
        }
        schemes.dedup();
        if schemes.len() > 1 {
            return bad("the etcd endpoints mix http and https".to_owned());
        }
        match (schemes[0], &self.tls) {
            ("https", None) => {
                return bad(
                    "https etcd endpoints need a CA file (--etcd-cacert or ETCDCTL_CACERT)"
                        .to_owned(),
                );
            }
            ("http", Some(_)) => {
                return bad("TLS files were given for http etcd endpoints".to_owned());
            }
            _ => {}
        }
        if let Some(tls) = &self.tls
            && tls.cert.is_some() != tls.key.is_some()
        {
            return bad(
                "an etcd client certificate needs its key, and a key its certificate".to_owned(),
            );
        }
        if self.request_timeout.is_zero() || self.call_timeout.is_zero() {
            return bad("etcd timeouts must be longer than zero".to_owned());
        }
        Ok(())
    }
}

/// The scheme of an endpoint that is a plain `http(s)://host:port` URL.
fn endpoint_scheme(endpoint: &str) -> Result<&'static str, EtcdError> {
    // The words never repeat the endpoint itself past its host: it might
    // hold credentials someone put there.
    let bad = |why: &str| {
        let shown = endpoint.split('@').next_back().unwrap_or_default();
        Err(EtcdError::Config(format!(
            "the etcd endpoint ending {shown:?} {why}; give http(s)://host:port"
        )))
    };
    let Ok(url) = reqwest::Url::parse(endpoint) else {
        return bad("is not a URL");
    };
    if !url.username().is_empty() || url.password().is_some() {
        return bad("holds user information (use ETCDCTL_USER for credentials)");
    }
    if url.host_str().is_none() || url.query().is_some() || url.fragment().is_some() {
        return bad("is not a plain host and port");
    }
    if !matches!(url.path(), "" | "/") {
        return bad("has a path");
    }
    match url.scheme() {
        "http" => Ok("http"),
        "https" => Ok("https"),
        _ => bad("is neither http nor https"),
    }
}

/// A TLS setup for plain `http` endpoints: never used to connect, but
/// reqwest built without a crypto provider of its own needs one.
pub(crate) fn unused_tls() -> Result<rustls::ClientConfig, EtcdError> {
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| EtcdError::Config(format!("cannot set up TLS: {e}")))?
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth())
}

/// The TLS setup on ring for `files`: only the given CA is trusted.
pub(crate) fn rustls_config(files: &TlsFiles) -> Result<rustls::ClientConfig, EtcdError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let tls_error = |path: &Path, reason: String| EtcdError::Tls {
        path: path.to_owned(),
        reason,
    };
    let mut roots = rustls::RootCertStore::empty();
    let cas = CertificateDer::pem_file_iter(&files.ca)
        .map_err(|e| tls_error(&files.ca, e.to_string()))?;
    for ca in cas {
        let ca = ca.map_err(|e| tls_error(&files.ca, e.to_string()))?;
        roots
            .add(ca)
            .map_err(|e| tls_error(&files.ca, e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(tls_error(&files.ca, "it holds no certificate".to_owned()));
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| tls_error(&files.ca, e.to_string()))?
    .with_root_certificates(roots);
    let (Some(cert), Some(key)) = (&files.cert, &files.key) else {
        return Ok(builder.with_no_client_auth());
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| tls_error(cert, e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| tls_error(cert, e.to_string()))?;
    // The key's own parse error is not repeated: it could quote key material.
    let private = PrivateKeyDer::from_pem_file(key)
        .map_err(|_| tls_error(key, "it holds no readable PEM private key".to_owned()))?;
    builder
        .with_client_auth_cert(chain, private)
        .map_err(|e| tls_error(cert, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| vars.get(name).cloned()
    }

    #[test]
    fn flags_win_over_the_environment_and_the_environment_fills_the_gaps() {
        let flags = EtcdFlags {
            endpoints: Some("https://a:2379, https://b:2379".to_owned()),
            cacert: Some("/flag/ca.pem".into()),
            ..EtcdFlags::default()
        };
        let vars = env(&[
            (ENDPOINTS_ENV, "https://env:2379"),
            (CACERT_ENV, "/env/ca.pem"),
            (CERT_ENV, "/env/cert.pem"),
            (KEY_ENV, "/env/key.pem"),
            (USER_ENV, "root:s3cret"),
        ]);
        let config = EtcdConfig::from_sources(&flags, vars).unwrap().unwrap();
        assert_eq!(config.endpoints, ["https://a:2379", "https://b:2379"]);
        let tls = config.tls.clone().unwrap();
        assert_eq!(tls.ca, PathBuf::from("/flag/ca.pem"));
        assert_eq!(tls.cert, Some(PathBuf::from("/env/cert.pem")));
        assert_eq!(tls.key, Some(PathBuf::from("/env/key.pem")));
        let auth = config.auth.clone().unwrap();
        assert_eq!((auth.user.as_str(), auth.password()), ("root", "s3cret"));
        assert!(!format!("{config:?}").contains("s3cret"), "{config:?}");
    }

    #[test]
    fn without_flags_or_environment_there_is_no_etcd() {
        assert_eq!(
            EtcdConfig::from_sources(&EtcdFlags::default(), env(&[])).unwrap(),
            None
        );
        let config = EtcdConfig::from_sources(
            &EtcdFlags::default(),
            env(&[
                (ENDPOINTS_ENV, "http://127.0.0.1:2379"),
                (USER_ENV, "alice"),
                (PASSWORD_ENV, "pw"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(config.tls, None);
        assert_eq!(config.auth, Some(Credentials::new("alice", "pw")));
    }

    #[test]
    fn unusable_configurations_are_refused_without_repeating_a_secret() {
        let cases: &[(&[&str], Option<TlsFiles>, &str)] = &[
            (&[], None, "no etcd endpoint"),
            (&["http://u:hunter2@h:1"], None, "user information"),
            (&["ftp://h:1"], None, "neither http nor https"),
            (&["http://h:1/v3"], None, "has a path"),
            (&["http://h:1", "https://h:2"], None, "mix http and https"),
            (&["https://h:1"], None, "need a CA file"),
            (
                &["http://h:1"],
                Some(TlsFiles {
                    ca: "/ca".into(),
                    cert: None,
                    key: None,
                }),
                "TLS files were given for http",
            ),
            (
                &["https://h:1"],
                Some(TlsFiles {
                    ca: "/ca".into(),
                    cert: Some("/c".into()),
                    key: None,
                }),
                "needs its key",
            ),
        ];
        for (endpoints, tls, words) in cases {
            let mut config = EtcdConfig::new(endpoints.iter().copied());
            config.tls = tls.clone();
            let e = config.validate().expect_err(words).to_string();
            assert!(e.contains(words), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
        let mut zero = EtcdConfig::new(["http://h:1"]);
        zero.request_timeout = Duration::ZERO;
        assert!(zero.validate().is_err());
    }

    #[test]
    fn a_tls_setup_reads_its_files_and_names_the_one_it_cannot_use() {
        let dir = tempfile::tempdir().unwrap();
        let missing = TlsFiles {
            ca: dir.path().join("ca.pem"),
            cert: None,
            key: None,
        };
        let e = rustls_config(&missing).unwrap_err().to_string();
        assert!(e.contains("ca.pem"), "{e}");
        std::fs::write(&missing.ca, "not a certificate").unwrap();
        let e = rustls_config(&missing).unwrap_err().to_string();
        assert!(e.contains("holds no certificate"), "{e}");
    }
}
