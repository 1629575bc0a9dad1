//! An instance ending itself: what a node's agent does on Vast.ai when its
//! daemon has renewed nothing for a whole lease.
//!
//! The service gives every instance a key of its own, in the container's
//! environment as `CONTAINER_API_KEY` with the instance's id in
//! `CONTAINER_ID`. That key can start, stop or destroy that one instance
//! and nothing else, so an agent holding it can end its own rental without
//! anything of the account ever reaching the machine. The agent is started
//! over SSH, whose sessions do not see the container's environment, so the
//! create's `onstart` (which does) copies both values to an owner-only file
//! in root's home ([`INSTANCE_FILE`]); the agent reads its environment
//! first, then that file.
//!
//! # Guarantees
//! - Only the instance's own key is ever sent, as a bearer header; it is
//!   never printed.
//! - A destroy is sent again after a failure that may pass (no answer, a
//!   5xx, a 429), a few times over about half a minute; a refusal of the
//!   key is final. An instance already gone counts as destroyed.

use super::api::{Api, ApiError, ApiKey, Endpoint, Pacing};
use super::model;
use serde_json::json;
use std::path::Path;
use std::time::Duration;

/// The file (relative to root's home on the instance) the `onstart` script
/// copies the instance's id and key to: `CONTAINER_ID=…` and
/// `CONTAINER_API_KEY=…` lines, readable by its owner only.
pub const INSTANCE_FILE: &str = ".swactor/vast-instance";

/// How long one destroy request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// The waits before each retry of a destroy that may pass.
const RETRY_WAITS: [Duration; 5] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
    Duration::from_secs(8),
    Duration::from_secs(15),
];

/// The instance an agent runs on, and the key that may end it.
pub struct OwnInstance {
    /// The instance's id.
    pub id: u64,
    key: ApiKey,
}

impl std::fmt::Debug for OwnInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnInstance")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl OwnInstance {
    /// The instance from `CONTAINER_ID` and `CONTAINER_API_KEY` in the
    /// environment, else from `file` (what `onstart` copied them to).
    ///
    /// # Errors
    /// Neither holds both, or what they hold is not an id and a key, in
    /// words that say where it looked.
    pub fn find(file: &Path) -> Result<Self, String> {
        let from_env = (
            std::env::var("CONTAINER_ID").ok(),
            std::env::var("CONTAINER_API_KEY").ok(),
        );
        if let (Some(id), Some(key)) = from_env {
            return Self::parse(&id, &key).map_err(|e| format!("in the environment: {e}"));
        }
        let text = std::fs::read_to_string(file).map_err(|e| {
            format!(
                "no CONTAINER_ID and CONTAINER_API_KEY in the environment, and {} cannot be read: {e}",
                file.display()
            )
        })?;
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
                .map(str::to_owned)
        };
        match (value("CONTAINER_ID"), value("CONTAINER_API_KEY")) {
            (Some(id), Some(key)) => {
                Self::parse(&id, &key).map_err(|e| format!("in {}: {e}", file.display()))
            }
            _ => Err(format!(
                "{} does not hold both CONTAINER_ID and CONTAINER_API_KEY (the service gave this instance no key of its own)",
                file.display()
            )),
        }
    }

    fn parse(id: &str, key: &str) -> Result<Self, String> {
        let id = id
            .trim()
            .parse()
            .map_err(|_| format!("CONTAINER_ID {:?} is not an instance id", id.trim()))?;
        let key = ApiKey::new(key).map_err(|_| "CONTAINER_API_KEY is empty or malformed")?;
        Ok(Self { id, key })
    }

    /// Destroys the instance through the service at `base` (the URL the
    /// daemon rents through), retrying what may pass.
    ///
    /// # Errors
    /// The service refused the key, or never answered, in words.
    pub async fn destroy(&self, base: &str) -> Result<(), String> {
        let api = Api::new(base, self.key.clone(), Pacing::none(), REQUEST_TIMEOUT)?;
        let id = self.id;
        let mut waits = RETRY_WAITS.iter();
        loop {
            let failure = match destroy_once(&api, id).await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            let retry = match &failure {
                ApiError::Status { status, .. } => *status == 429 || *status >= 500,
                _ => true,
            };
            match waits.next() {
                Some(wait) if retry => {
                    tracing::warn!(
                        instance = id,
                        "destroying this instance failed ({failure}); trying again in {wait:?}"
                    );
                    tokio::time::sleep(*wait).await;
                }
                _ => return Err(format!("cannot destroy instance {id}: {failure}")),
            }
        }
    }
}

/// One `DELETE` of instance `id` (with whichever key `api` holds); an
/// instance already gone is success, and an answer that says it was not
/// destroyed is a status 200 error with the service's words.
pub(super) async fn destroy_once(api: &Api, id: u64) -> Result<(), ApiError> {
    let path = format!("/api/v0/instances/{id}/");
    let result = api
        .call(
            Endpoint::Destroy,
            reqwest::Method::DELETE,
            &path,
            &[],
            Some(&json!({})),
        )
        .await;
    match result {
        Ok(body)
            if body.get("success").and_then(serde_json::Value::as_bool) == Some(false)
                && !model::destroy_absent(200, &body.to_string()) =>
        {
            Err(ApiError::Status {
                status: 200,
                body: model::message_of(&body),
            })
        }
        Ok(_) => Ok(()),
        Err(ApiError::Status { status, body }) if model::destroy_absent(status, &body) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_gives_the_id_and_key_and_a_half_file_is_refused_in_words() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("vast-instance");
        std::fs::write(&file, "CONTAINER_ID=42\nCONTAINER_API_KEY=abc123\n").unwrap();
        // The test process has no CONTAINER_ID of its own.
        assert!(std::env::var("CONTAINER_ID").is_err());
        let own = OwnInstance::find(&file).unwrap();
        assert_eq!(own.id, 42);
        assert!(!format!("{own:?}").contains("abc123"));
        std::fs::write(&file, "CONTAINER_ID=42\n").unwrap();
        let e = OwnInstance::find(&file).unwrap_err();
        assert!(e.contains("does not hold both"), "{e}");
        std::fs::write(&file, "CONTAINER_ID=x\nCONTAINER_API_KEY=k\n").unwrap();
        let e = OwnInstance::find(&file).unwrap_err();
        assert!(e.contains("not an instance id"), "{e}");
        let e = OwnInstance::find(&dir.path().join("absent")).unwrap_err();
        assert!(e.contains("cannot be read"), "{e}");
    }
}
