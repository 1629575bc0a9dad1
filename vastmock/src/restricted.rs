//! The restricted per-instance key: which key a call presents, what an instance's own key may do, and the destroy log.
//!
//! The service gives every instance a key of its own (`CONTAINER_API_KEY`
//! in the container's environment) that can start, stop or destroy that
//! one instance and nothing else. [`allows`] is that rule, as a pure
//! function of the call; the world decides which key a call presents and
//! records every destroy as a [`Destroy`].

use crate::faults::SplitMix64;
use crate::world::{Call, Reply};
use serde_json::{Value, json};
use std::io::Read;

/// Which key a call was made with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyUse {
    /// The account's API key ([`crate::VastMock::api_key`]).
    Account,
    /// The restricted key of the instance with this id
    /// ([`crate::VastMock::instance_key`], its `CONTAINER_API_KEY`).
    Instance(u64),
}

/// One successful destroy (single or bulk), as [`crate::VastMock::destroys`] lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Destroy {
    /// The instance destroyed.
    pub instance: u64,
    /// The key that destroyed it.
    pub by: KeyUse,
}

impl Destroy {
    /// The stderr line that tells of it, naming the key by its kind (never the key).
    pub(crate) fn line(&self) -> String {
        match self.by {
            KeyUse::Account => format!(
                "swactor-vastmock: instance {} destroyed with the account key",
                self.instance
            ),
            KeyUse::Instance(own) if own == self.instance => format!(
                "swactor-vastmock: instance {} destroyed with its own restricted key (CONTAINER_API_KEY)",
                self.instance
            ),
            // `allows` never lets this happen; say so plainly if it ever does.
            KeyUse::Instance(own) => format!(
                "swactor-vastmock: instance {} destroyed with the restricted key of instance {own}",
                self.instance
            ),
        }
    }
}

/// Bytes of randomness in a restricted key (64 hex digits, as the service's keys).
const KEY_BYTES: usize = 32;

/// A new restricted key: [`KEY_BYTES`] random bytes from the system's
/// generator, in lowercase hex. `fallback` (seeded from the clock) is only
/// used when `/dev/urandom` cannot be read.
pub(crate) fn new_key(fallback: &mut SplitMix64) -> String {
    let mut bytes = [0u8; KEY_BYTES];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if read.is_err() {
        for chunk in bytes.chunks_mut(8) {
            let n = chunk.len();
            chunk.copy_from_slice(&fallback.next_u64().to_le_bytes()[..n]);
        }
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether the restricted key of instance `own` may make `call`: only a
/// destroy of `own`, a start or stop of `own` (a body of `state` alone),
/// and the bulk forms of those whose every id is `own`.
pub(crate) fn allows(own: u64, call: &Call) -> bool {
    match call {
        Call::Destroy { id } => *id == own,
        Call::Update { id, body } => *id == own && is_state_only(body, &[]),
        Call::UpdateBulk { body } => only_own(body, "ids", own) && is_state_only(body, &["ids"]),
        Call::DestroyBulk { body } => only_own(body, "instance_ids", own),
        _ => false,
    }
}

/// The answer to a call the restricted key of instance `own` may not make.
pub(crate) fn permission_denied(own: u64) -> Reply {
    Reply::json(
        403,
        json!({
            "success": false,
            "error": "permission_denied",
            "msg": format!("Permission denied: this key may only start, stop or destroy instance {own}"),
        }),
    )
}

/// Whether `body` is an object holding `{"state": "stopped" | "running"}`
/// and nothing else but the fields `also`.
fn is_state_only(body: &Value, also: &[&str]) -> bool {
    let Value::Object(b) = body else {
        return false;
    };
    let state_ok = matches!(
        b.get("state").and_then(Value::as_str),
        Some("stopped" | "running")
    );
    state_ok && b.keys().all(|k| k == "state" || also.contains(&k.as_str()))
}

/// Whether `body[field]` is a non-empty list of ids, each of them `own`.
fn only_own(body: &Value, field: &str, own: u64) -> bool {
    match body.get(field) {
        Some(Value::Array(ids)) => !ids.is_empty() && ids.iter().all(|id| id_of(id) == Some(own)),
        _ => false,
    }
}

/// An id as a bulk body lists it: a number, or a string of one.
fn id_of(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: u64 = 24_000_001;

    #[test]
    fn an_instance_key_may_destroy_start_and_stop_its_own_instance_only() {
        assert!(allows(OWN, &Call::Destroy { id: OWN }));
        assert!(!allows(OWN, &Call::Destroy { id: OWN + 1 }));
        for state in ["stopped", "running"] {
            let body = json!({"state": state});
            assert!(allows(
                OWN,
                &Call::Update {
                    id: OWN,
                    body: body.clone()
                }
            ));
            assert!(!allows(OWN, &Call::Update { id: OWN + 1, body }));
        }
        let call = |body: Value| Call::Update { id: OWN, body };
        assert!(!allows(OWN, &call(json!({"label": "x"}))));
        assert!(!allows(
            OWN,
            &call(json!({"state": "stopped", "label": "x"}))
        ));
        assert!(!allows(OWN, &call(json!({"state": "rebooting"}))));
        assert!(!allows(OWN, &call(json!("state"))));
        assert!(!allows(OWN, &Call::Show { id: OWN }));
        assert!(!allows(OWN, &Call::Reboot { id: OWN }));
        assert!(!allows(OWN, &Call::ListV0));
        assert!(!allows(OWN, &Call::CurrentUser));
        assert!(!allows(OWN, &Call::Search { body: json!({}) }));
        assert!(!allows(
            OWN,
            &Call::Create {
                offer_id: 3_100_001,
                body: json!({"image": "ubuntu:22.04"})
            }
        ));
    }

    #[test]
    fn an_instance_key_may_use_the_bulk_forms_only_when_every_id_is_its_own() {
        let bulk = |body: Value| Call::UpdateBulk { body };
        assert!(allows(
            OWN,
            &bulk(json!({"ids": [OWN], "state": "stopped"}))
        ));
        assert!(allows(
            OWN,
            &bulk(json!({"ids": [OWN, OWN], "state": "running"}))
        ));
        assert!(!allows(
            OWN,
            &bulk(json!({"ids": [OWN, 1], "state": "stopped"}))
        ));
        assert!(!allows(OWN, &bulk(json!({"ids": [OWN], "label": "x"}))));
        assert!(!allows(OWN, &bulk(json!({"ids": [], "state": "stopped"}))));
        let destroy = |body: Value| Call::DestroyBulk { body };
        assert!(allows(OWN, &destroy(json!({"instance_ids": [OWN]}))));
        assert!(allows(
            OWN,
            &destroy(json!({"instance_ids": [OWN.to_string()]}))
        ));
        assert!(!allows(
            OWN,
            &destroy(json!({"instance_ids": [OWN, OWN + 1]}))
        ));
        assert!(!allows(OWN, &destroy(json!({"instance_ids": []}))));
        assert!(!allows(OWN, &destroy(json!({"ids": [OWN]}))));
    }

    #[test]
    fn keys_are_64_hex_digits_and_differ() {
        let mut fallback = SplitMix64::new(1);
        let (a, b) = (new_key(&mut fallback), new_key(&mut fallback));
        assert_eq!(a.len(), 64);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(a, b);
    }

    #[test]
    fn the_destroy_line_names_the_key_by_its_kind() {
        let own = Destroy {
            instance: OWN,
            by: KeyUse::Instance(OWN),
        };
        assert!(
            own.line().contains("its own restricted key"),
            "{}",
            own.line()
        );
        let account = Destroy {
            instance: OWN,
            by: KeyUse::Account,
        };
        assert!(account.line().ends_with("with the account key"));
    }
}
