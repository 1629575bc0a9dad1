//! A group's container settings, read and checked from its template.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use swactor_provisioning::{NodeTemplate, ParamValue};

/// Least memory a node's container may be given: an idle agent alone holds
/// about this much, so less would only get it killed for lack of memory.
pub const MEMORY_MB_MIN: i64 = 32;
/// Most memory a node's container may be given (1 TiB).
pub const MEMORY_MB_MAX: i64 = 1 << 20;
/// Most CPUs a node's container may be given.
pub const CPUS_MAX: f64 = 1024.0;
/// Most bind mounts one group may declare.
pub const MOUNTS_MAX: usize = 64;

/// The parameters a `docker` group may set.
const KNOWN_PARAMS: [&str; 4] = ["image", "memory_mb", "cpus", "mounts"];

/// What a group's containers are made with, read from its template.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct NodeOptions {
    /// The group's own image; `None` for the agent image the provider builds.
    pub(crate) image: Option<String>,
    /// Memory limit in bytes (swap included: the container gets no swap).
    pub(crate) memory_bytes: Option<i64>,
    /// CPU limit in billionths of a CPU.
    pub(crate) nano_cpus: Option<i64>,
    /// Bind mounts.
    pub(crate) mounts: Vec<BindMount>,
    /// `NAME=value` pairs for the container.
    pub(crate) env: Vec<String>,
}

/// One bind mount of a host path into the container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BindMount {
    /// Absolute path on this machine.
    pub(crate) host: PathBuf,
    /// Absolute path in the container.
    pub(crate) container: String,
    /// Writable from the container; read-only unless the group says `:rw`.
    pub(crate) writable: bool,
}

impl BindMount {
    /// The engine's `host:container:ro|rw` form.
    pub(crate) fn bind(&self) -> String {
        format!(
            "{}:{}:{}",
            self.host.display(),
            self.container,
            if self.writable { "rw" } else { "ro" }
        )
    }
}

impl NodeOptions {
    /// Reads the options from `template` without touching the file system.
    ///
    /// # Errors
    /// The first problem, worded for the shape's author.
    pub(crate) fn parse(template: &NodeTemplate) -> Result<Self, String> {
        let params = &template.provider.params;
        check_known(params)?;
        let image = image_of(params.get("image"), template.boot.image.as_ref())?;
        let memory_bytes = memory_bytes_of(params.get("memory_mb"))?;
        let nano_cpus = nano_cpus_of(params.get("cpus"))?;
        let mounts = mounts_of(params.get("mounts"))?;
        let env = env_of(template)?;
        if template.boot.boot_check.iter().any(|a| a.contains('\0')) {
            return Err("a boot check argument holds a NUL character".to_owned());
        }
        Ok(Self {
            image,
            memory_bytes,
            nano_cpus,
            mounts,
            env,
        })
    }

    /// Checks what only this machine can tell: every mount's host path exists.
    ///
    /// # Errors
    /// The first mount whose host path is missing or cannot be looked at.
    pub(crate) fn check_host(&self) -> Result<(), String> {
        for m in &self.mounts {
            check_host_path(&m.host)?;
        }
        Ok(())
    }
}

/// Checks a `docker` group's template: its parameters, its environment and
/// that its mounts' host paths exist on this machine.
///
/// # Errors
/// The first problem, worded for the shape's author.
pub fn check_template(template: &NodeTemplate) -> Result<(), String> {
    NodeOptions::parse(template)?.check_host()
}

/// Refuses a parameter the provider does not know.
fn check_known(params: &BTreeMap<String, ParamValue>) -> Result<(), String> {
    for name in params.keys() {
        if !KNOWN_PARAMS.contains(&name.as_str()) {
            return Err(format!(
                "unknown parameter `{name}` (known: {})",
                KNOWN_PARAMS.join(", ")
            ));
        }
    }
    Ok(())
}

/// The group's own image, named once by `params.image` or the group's `image`.
fn image_of(param: Option<&ParamValue>, boot: Option<&String>) -> Result<Option<String>, String> {
    match (param, boot) {
        (None, None) => Ok(None),
        (Some(ParamValue::Str(a)), Some(b)) if a != b => Err(format!(
            "`image` in [group.params] is {a:?} but the group's `image` is {b:?}; \
             name the image once"
        )),
        (Some(ParamValue::Str(name)), _) | (None, Some(name)) => Ok(Some(check_image(name)?)),
        (Some(other), _) => Err(format!("`image` must be an image name, not {other}")),
    }
}

/// The memory limit in bytes, from `memory_mb`.
fn memory_bytes_of(param: Option<&ParamValue>) -> Result<Option<i64>, String> {
    match param {
        None => Ok(None),
        Some(ParamValue::Int(mb)) if *mb < MEMORY_MB_MIN => Err(format!(
            "`memory_mb` is {mb}; under {MEMORY_MB_MIN} MB is refused: the agent alone needs about that much"
        )),
        Some(ParamValue::Int(mb)) if *mb > MEMORY_MB_MAX => Err(format!(
            "`memory_mb` is {mb}; the most accepted is {MEMORY_MB_MAX}"
        )),
        Some(ParamValue::Int(mb)) => Ok(Some(mb * (1 << 20))),
        Some(other) => Err(format!(
            "`memory_mb` must be a whole number of megabytes, not {other}"
        )),
    }
}

/// The CPU limit in billionths of a CPU, from `cpus`.
fn nano_cpus_of(param: Option<&ParamValue>) -> Result<Option<i64>, String> {
    let Some(value) = param else {
        return Ok(None);
    };
    let cpus = match value {
        ParamValue::Int(n) => *n as f64,
        ParamValue::Float(f) => *f,
        other => {
            return Err(format!("`cpus` must be a number, not {other}"));
        }
    };
    // At least a thousandth of a CPU: the engine refuses less.
    if !(cpus.is_finite() && (0.001..=CPUS_MAX).contains(&cpus)) {
        return Err(format!(
            "`cpus` is {cpus}; it must be between 0.001 and {CPUS_MAX}"
        ));
    }
    Ok(Some((cpus * 1e9).round() as i64))
}

/// The bind mounts `mounts` lists, at most [`MOUNTS_MAX`].
fn mounts_of(param: Option<&ParamValue>) -> Result<Vec<BindMount>, String> {
    match param {
        None => Ok(Vec::new()),
        Some(ParamValue::List(list)) if list.len() > MOUNTS_MAX => Err(format!(
            "`mounts` lists {} mounts; the most accepted is {MOUNTS_MAX}",
            list.len()
        )),
        Some(ParamValue::List(list)) => list
            .iter()
            .map(|m| match m {
                ParamValue::Str(text) => parse_mount(text),
                other => Err(format!(
                    "every mount must be a string \"host:container[:rw]\", not {other}"
                )),
            })
            .collect(),
        Some(other) => Err(format!(
            "`mounts` must be a list of \"host:container[:rw]\", not {other}"
        )),
    }
}

/// The container's `NAME=value` pairs, from the group's environment.
fn env_of(template: &NodeTemplate) -> Result<Vec<String>, String> {
    let mut env = Vec::with_capacity(template.boot.env.len());
    for (name, value) in &template.boot.env {
        check_env_name(name)?;
        if value.contains('\0') {
            return Err(format!("environment variable {name} holds a NUL character"));
        }
        env.push(format!("{name}={value}"));
    }
    Ok(env)
}

fn check_image(name: &str) -> Result<String, String> {
    if name.is_empty() {
        return Err("`image` must not be empty".to_owned());
    }
    if name.starts_with('-') || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("`image` {name:?} is not an image name"));
    }
    Ok(name.to_owned())
}

/// An environment variable name as a POSIX shell takes it.
fn check_env_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let valid = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if valid {
        Ok(())
    } else {
        Err(format!(
            "environment variable name {name:?} is invalid: use letters, digits and `_`, not starting with a digit"
        ))
    }
}

/// `host:container[:rw|:ro]`, both paths absolute.
fn parse_mount(text: &str) -> Result<BindMount, String> {
    let bad = |why: &str| {
        Err(format!(
            "mount {text:?}: {why} (write \"host:container[:rw]\")"
        ))
    };
    let parts: Vec<&str> = text.split(':').collect();
    let (host, container, writable) = match parts.as_slice() {
        [host, container] => (*host, *container, false),
        [host, container, "rw"] => (*host, *container, true),
        [host, container, "ro"] => (*host, *container, false),
        [_, _, mode] => return bad(&format!("unknown mode {mode:?}; use rw or ro")),
        _ => return bad("expected two or three parts separated by `:`"),
    };
    if !host.starts_with('/') || !container.starts_with('/') {
        return bad("both paths must be absolute");
    }
    if host.contains(',') || container.contains(',') {
        return bad("paths must not contain `,`");
    }
    Ok(BindMount {
        host: PathBuf::from(host),
        container: container.to_owned(),
        writable,
    })
}

fn check_host_path(path: &Path) -> Result<(), String> {
    match std::fs::metadata(path) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(format!(
            "mount source {} does not exist on this machine (the engine would create an empty directory in its place)",
            path.display()
        )),
        Err(e) => Err(format!("mount source {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use swactor_provisioning::{BootParams, ProviderShape, SwarmJoin};

    fn template(params: &[(&str, ParamValue)], env: &[(&str, &str)]) -> NodeTemplate {
        NodeTemplate {
            provider: ProviderShape {
                kind: "docker".to_owned(),
                params: params
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), v.clone()))
                    .collect(),
                placement: BTreeMap::new(),
            },
            boot: BootParams {
                env: env
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
                ..BootParams::default()
            },
            role: "worker".to_owned(),
            join: SwarmJoin::default(),
            limits: Default::default(),
        }
    }

    fn err(params: &[(&str, ParamValue)], env: &[(&str, &str)]) -> String {
        NodeOptions::parse(&template(params, env)).unwrap_err()
    }

    #[test]
    fn every_option_is_read_into_what_the_engine_takes() {
        let o = NodeOptions::parse(&template(
            &[
                ("image", ParamValue::Str("busybox:1".to_owned())),
                ("memory_mb", ParamValue::Int(64)),
                ("cpus", ParamValue::Float(1.5)),
                (
                    "mounts",
                    ParamValue::List(vec![
                        ParamValue::Str("/data:/in".to_owned()),
                        ParamValue::Str("/out:/out:rw".to_owned()),
                    ]),
                ),
            ],
            &[("RUST_LOG", "debug"), ("_X1", "a=b")],
        ))
        .unwrap();
        assert_eq!(o.image.as_deref(), Some("busybox:1"));
        assert_eq!(o.memory_bytes, Some(64 << 20));
        assert_eq!(o.nano_cpus, Some(1_500_000_000));
        let binds: Vec<String> = o.mounts.iter().map(BindMount::bind).collect();
        assert_eq!(binds, ["/data:/in:ro", "/out:/out:rw"]);
        assert_eq!(o.env, ["RUST_LOG=debug", "_X1=a=b"]);
        let none = NodeOptions::parse(&template(&[], &[])).unwrap();
        assert_eq!(none.image, None);
        assert!(none.mounts.is_empty() && none.memory_bytes.is_none());
    }

    #[test]
    fn bad_options_are_refused_with_the_reason() {
        let e = err(&[("memory_mb", ParamValue::Int(16))], &[]);
        assert!(e.contains("under 32 MB is refused"), "{e}");
        let e = err(&[], &[("1BAD", "x")]);
        assert!(e.contains("\"1BAD\" is invalid"), "{e}");
        let e = err(&[], &[("A-B", "x")]);
        assert!(e.contains("\"A-B\" is invalid"), "{e}");
        let e = err(&[("gpus", ParamValue::Int(1))], &[]);
        assert!(e.contains("unknown parameter `gpus`"), "{e}");
        let e = err(&[("cpus", ParamValue::Float(0.0))], &[]);
        assert!(e.contains("`cpus` is 0"), "{e}");
        let e = err(&[("image", ParamValue::Str(String::new()))], &[]);
        assert!(e.contains("must not be empty"), "{e}");
        for (mount, why) in [
            ("data:/in", "absolute"),
            ("/data", "two or three parts"),
            ("/data:/in:rx", "unknown mode"),
        ] {
            let e = err(
                &[(
                    "mounts",
                    ParamValue::List(vec![ParamValue::Str(mount.to_owned())]),
                )],
                &[],
            );
            assert!(e.contains(why), "{mount}: {e}");
        }
    }

    #[test]
    fn a_missing_mount_source_is_refused_on_this_machine() {
        let t = template(
            &[(
                "mounts",
                ParamValue::List(vec![ParamValue::Str(
                    "/nonexistent/swactor-test:/in".to_owned(),
                )]),
            )],
            &[],
        );
        let e = check_template(&t).unwrap_err();
        assert!(
            e.contains("/nonexistent/swactor-test does not exist"),
            "{e}"
        );
    }
}
