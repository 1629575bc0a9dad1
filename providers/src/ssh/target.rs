//! Where an SSH session goes: `user@host:port`.

use std::fmt;
use std::str::FromStr;

/// The port used when a target names none.
pub const DEFAULT_PORT: u16 = 22;

/// A user on a host's SSH server, written `user@host`, `user@host:port` or,
/// for an IPv6 address, `user@[::1]:port`. The port is 22 when omitted.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SshTarget {
    /// The remote user.
    pub user: String,
    /// A host name or an IP address (IPv6 without brackets).
    pub host: String,
    /// The SSH server's TCP port.
    pub port: u16,
}

/// A target string that is not `user@host[:port]`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "malformed SSH target `{entry}`: {reason}; expected `user@host`, `user@host:port` \
     or `user@[ipv6]:port`"
)]
pub struct SshTargetError {
    /// The text as given.
    pub entry: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl SshTarget {
    /// The host as OpenSSH writes it in `known_hosts`: `host` for port 22,
    /// `[host]:port` otherwise.
    pub fn known_hosts_name(&self) -> String {
        if self.port == DEFAULT_PORT {
            self.host.clone()
        } else {
            format!("[{}]:{}", self.host, self.port)
        }
    }
}

impl FromStr for SshTarget {
    type Err = SshTargetError;

    fn from_str(entry: &str) -> Result<Self, Self::Err> {
        let fail = |reason| SshTargetError {
            entry: entry.to_owned(),
            reason,
        };
        if entry.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(fail("it contains whitespace or control characters"));
        }
        let (user, rest) = entry.split_once('@').ok_or(fail("the user is missing"))?;
        if user.is_empty() {
            return Err(fail("the user is empty"));
        }
        if user.contains(':') || user.starts_with('-') {
            return Err(fail("the user contains `:` or starts with `-`"));
        }
        let (host, port) = if let Some(bracketed) = rest.strip_prefix('[') {
            let (host, after) = bracketed
                .split_once(']')
                .ok_or(fail("`[` opens an IPv6 address that no `]` closes"))?;
            if host.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(fail("the text in brackets is not an IPv6 address"));
            }
            let port = match after {
                "" => None,
                _ => Some(
                    after
                        .strip_prefix(':')
                        .ok_or(fail("only `:port` may follow `]`"))?,
                ),
            };
            (host, port)
        } else {
            match rest.split_once(':') {
                Some((_, after)) if after.contains(':') => {
                    return Err(fail("an IPv6 address must be in brackets"));
                }
                Some((host, port)) => (host, Some(port)),
                None => (rest, None),
            }
        };
        if host.is_empty() {
            return Err(fail("the host is empty"));
        }
        if host.contains(['@', '[', ']', '/']) || host.starts_with('-') {
            return Err(fail(
                "the host contains `@`, `[`, `]` or `/`, or starts with `-`",
            ));
        }
        let port = match port {
            None => DEFAULT_PORT,
            Some(text) => match text.parse::<u16>() {
                Ok(port) if port != 0 && !text.starts_with('+') => port,
                _ => return Err(fail("the port is not a number from 1 to 65535")),
            },
        };
        Ok(Self {
            user: user.to_owned(),
            host: host.to_owned(),
            port,
        })
    }
}

impl fmt::Display for SshTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bracketed = self.host.contains(':');
        match (bracketed, self.port) {
            (false, DEFAULT_PORT) => write!(f, "{}@{}", self.user, self.host),
            (false, port) => write!(f, "{}@{}:{port}", self.user, self.host),
            (true, DEFAULT_PORT) => write!(f, "{}@[{}]", self.user, self.host),
            (true, port) => write!(f, "{}@[{}]:{port}", self.user, self.host),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(user: &str, host: &str, port: u16) -> SshTarget {
        SshTarget {
            user: user.into(),
            host: host.into(),
            port,
        }
    }

    #[test]
    fn targets_parse_in_every_documented_form_and_print_back_the_same() {
        for (text, want) in [
            ("root@10.0.0.5:2222", target("root", "10.0.0.5", 2222)),
            (
                "ubuntu@gpu-1.example",
                target("ubuntu", "gpu-1.example", 22),
            ),
            ("root@[::1]:2222", target("root", "::1", 2222)),
            ("root@[fe80::1]", target("root", "fe80::1", 22)),
        ] {
            let parsed: SshTarget = text.parse().unwrap();
            assert_eq!(parsed, want, "{text}");
            assert_eq!(parsed.to_string(), text);
        }
        // Port 22 is the default and is not printed.
        let t: SshTarget = "a@h:22".parse().unwrap();
        assert_eq!(t, target("a", "h", 22));
        assert_eq!(t.to_string(), "a@h");
        assert_eq!(t.known_hosts_name(), "h");
        assert_eq!(target("a", "h", 2200).known_hosts_name(), "[h]:2200");
        assert_eq!(target("a", "::1", 2200).known_hosts_name(), "[::1]:2200");
    }

    #[test]
    fn malformed_targets_are_refused_naming_the_entry_and_the_expected_form() {
        for (text, why) in [
            ("host", "user is missing"),
            ("@host", "user is empty"),
            ("root@", "host is empty"),
            ("root@:22", "host is empty"),
            ("root@host:", "port"),
            ("root@host:0", "port"),
            ("root@host:70000", "port"),
            ("root@host:+22", "port"),
            ("root@host:ssh", "port"),
            ("root@::1", "brackets"),
            ("root@[::1", "closes"),
            ("root@[::1]2222", "`:port`"),
            ("root@[not-v6]:22", "IPv6"),
            ("root@a@b", "`@`"),
            ("root@-oProxyCommand=x", "starts with `-`"),
            ("-o@host", "starts with `-`"),
            ("root@ho st", "whitespace"),
        ] {
            let err = text.parse::<SshTarget>().unwrap_err();
            let shown = err.to_string();
            assert!(shown.contains(&format!("`{text}`")), "{shown}");
            assert!(shown.contains(why), "{text}: {shown}");
            assert!(shown.contains("expected `user@host`"), "{shown}");
        }
    }
}
