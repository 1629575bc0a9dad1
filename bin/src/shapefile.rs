//! Shape files: the TOML a user writes, turned into a cluster shape.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use swactor_provisioning::{
    BootParams, ClusterShape, Generation, GroupShape, NodeLimits, ParamValue, PolicyShape,
    ProviderShape, Quantity, RunId, ShapeError, SwarmJoin,
};

use crate::words::cut;

/// Provider kinds whose groups list the hosts their nodes go to.
pub(crate) const PLACED_ON_HOSTS: &[&str] = &["ssh"];

/// Provider kinds this daemon can drive.
pub(crate) const SUPPORTED_PROVIDERS: &[&str] = &["process", "ssh", "docker", "vast"];

/// A shape as written in a file: the generation is optional (the daemon
/// assigns the next one on apply, as a Kubernetes API server does).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ShapeFile {
    /// The run; required ([`ShapeFile::check`] refuses a file without one),
    /// optional here so that its absence gets a message of its own.
    #[serde(default)]
    pub(crate) run: Option<String>,
    /// An explicit generation, if the author wants one.
    #[serde(default)]
    pub(crate) generation: Option<u64>,
    /// The most nodes this shape may hold, overriding the provider's own
    /// estimate (e.g. this machine's memory for local processes).
    #[serde(default)]
    pub(crate) capacity: Option<u64>,
    /// The node groups.
    #[serde(default, rename = "group")]
    pub(crate) groups: Vec<GroupFile>,
}

/// One group as written in a file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GroupFile {
    /// Group id; nodes are named `{id}-{index}`.
    pub(crate) id: String,
    /// How many nodes.
    pub(crate) count: u32,
    /// The provider kind (`process`).
    pub(crate) provider: String,
    /// Provider parameters.
    #[serde(default)]
    pub(crate) params: BTreeMap<String, ParamValue>,
    /// The role (`worker` by default); recorded with the template.
    #[serde(default)]
    pub(crate) role: Option<String>,
    /// A command the agent runs to check the node is fit, as argv.
    #[serde(default)]
    pub(crate) boot_check: Vec<String>,
    /// A machine image, for providers that take one.
    #[serde(default)]
    pub(crate) image: Option<String>,
    /// Environment for the agent.
    #[serde(default)]
    pub(crate) env: BTreeMap<String, String>,
    /// Tags recorded with the template (nothing acts on them yet).
    #[serde(default)]
    pub(crate) tags: BTreeSet<String>,
    /// Seconds a joined agent may be gone before its node is replaced.
    #[serde(default)]
    pub(crate) lost_grace_s: Option<f64>,
    /// Seconds a leased machine may take to report a reachable endpoint.
    #[serde(default)]
    pub(crate) endpoint_timeout_s: Option<f64>,
    /// Seconds the boot check may run before the agent stops it.
    #[serde(default)]
    pub(crate) boot_timeout_s: Option<f64>,
    /// Where nodes may be placed (`ssh`: the pool's hosts, `user@host:port`,
    /// each maybe with labels). Changing it moves no node already placed.
    #[serde(default)]
    pub(crate) hosts: Vec<HostEntry>,
    /// Most nodes a template change may have unavailable at once: a count
    /// or `"25%"` (default 1). Changing it replaces no node.
    #[serde(default)]
    pub(crate) max_unavailable: Option<Quantity>,
    /// Extra nodes a rollout may make; only 0 is supported.
    #[serde(default)]
    pub(crate) max_surge: Option<Quantity>,
    /// Most unhealthy nodes before lost ones stop being replaced: a count
    /// or `"40%"` (default: no limit). Changing it replaces no node.
    #[serde(default)]
    pub(crate) max_unhealthy: Option<Quantity>,
}

/// One host of a pool: `"user@host:port"`, or
/// `{ host = "user@host:port", labels = ["gpu", …] }`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub(crate) enum HostEntry {
    /// A host without labels.
    Plain(String),
    /// A host with labels, handed to its agents in `SWACTOR_HOST_LABELS`.
    Labelled(LabelledHost),
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LabelledHost {
    host: String,
    #[serde(default)]
    labels: Vec<String>,
}

impl HostEntry {
    fn host(&self) -> &str {
        match self {
            Self::Plain(h) => h,
            Self::Labelled(l) => &l.host,
        }
    }

    fn labels(&self) -> &[String] {
        match self {
            Self::Plain(_) => &[],
            Self::Labelled(l) => &l.labels,
        }
    }
}

/// A group's placement: `hosts`, and `labels` (a list per host) when any
/// host has labels.
fn placement(hosts: &[HostEntry]) -> BTreeMap<String, ParamValue> {
    let mut placement = BTreeMap::new();
    if hosts.is_empty() {
        return placement;
    }
    let list = |items: Vec<ParamValue>| ParamValue::List(items);
    placement.insert(
        "hosts".to_owned(),
        list(
            hosts
                .iter()
                .map(|h| ParamValue::Str(h.host().to_owned()))
                .collect(),
        ),
    );
    if hosts.iter().any(|h| !h.labels().is_empty()) {
        let labels = hosts
            .iter()
            .map(|h| list(h.labels().iter().cloned().map(ParamValue::Str).collect()))
            .collect();
        placement.insert("labels".to_owned(), list(labels));
    }
    placement
}

impl ShapeFile {
    /// Parses TOML; errors name the line and column.
    ///
    /// # Errors
    /// Malformed TOML or an unknown field.
    pub(crate) fn parse(text: &str, origin: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| {
            let (line, col) = e.span().map(|s| line_col(text, s.start)).unwrap_or((0, 0));
            let message = match e.message().trim_end() {
                m if m.contains("untagged enum HostEntry") => {
                    "a host is \"user@host:port\" or { host = \"user@host:port\", labels = [\"…\"] }, \
                     with no other keys"
                }
                m => m,
            };
            anyhow::anyhow!(
                "{origin}:{line}:{col}: {message} (the shape file is not valid; nothing was changed)"
            )
        })
    }

    /// Reads and parses a shape file.
    ///
    /// # Errors
    /// The file cannot be read or parsed.
    pub(crate) fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the shape file {}", path.display()))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// The run this file is for (empty when it names none, which
    /// [`ShapeFile::check`] refuses).
    pub(crate) fn run_id(&self) -> RunId {
        RunId::new(self.run.clone().unwrap_or_default())
    }

    /// The cluster shape at `generation` (the file's own one wins if it has one).
    ///
    /// # Errors
    /// A provider kind this daemon cannot drive.
    pub(crate) fn to_shape(&self, generation: u64) -> Result<ClusterShape> {
        for (i, g) in self.groups.iter().enumerate() {
            if !SUPPORTED_PROVIDERS.contains(&g.provider.as_str()) {
                bail!(
                    "group[{i}] ({:?}) asks for provider {:?}, which this daemon cannot drive; \
                     supported: {}",
                    cut(&g.id),
                    cut(&g.provider),
                    SUPPORTED_PROVIDERS.join(", ")
                );
            }
            if !g.hosts.is_empty() && !PLACED_ON_HOSTS.contains(&g.provider.as_str()) {
                bail!(
                    "group[{i}] ({:?}) lists `hosts`, which provider {:?} does not use (only {} does)",
                    cut(&g.id),
                    cut(&g.provider),
                    PLACED_ON_HOSTS.join(", ")
                );
            }
        }
        let groups = self
            .groups
            .iter()
            .map(|g| GroupShape {
                id: g.id.clone(),
                run_id: None,
                count: g.count,
                provider: ProviderShape {
                    kind: g.provider.clone(),
                    params: g.params.clone(),
                    placement: placement(&g.hosts),
                },
                boot: BootParams {
                    image: g.image.clone(),
                    boot_check: g.boot_check.clone(),
                    env: g.env.clone(),
                },
                role: g.role.clone().unwrap_or_else(|| "worker".to_owned()),
                join: SwarmJoin {
                    tags: g.tags.clone(),
                    lost_grace_s: g.lost_grace_s.unwrap_or(SwarmJoin::default().lost_grace_s),
                },
                limits: NodeLimits {
                    endpoint_timeout_s: g
                        .endpoint_timeout_s
                        .unwrap_or(NodeLimits::default().endpoint_timeout_s),
                    boot_timeout_s: g
                        .boot_timeout_s
                        .unwrap_or(NodeLimits::default().boot_timeout_s),
                },
                policy: PolicyShape {
                    max_unavailable: g.max_unavailable,
                    max_surge: g.max_surge,
                    max_unhealthy: g.max_unhealthy,
                },
            })
            .collect();
        Ok(ClusterShape {
            run_id: self.run_id(),
            generation: Generation(self.generation.unwrap_or(generation)),
            groups,
            capacity: self.capacity,
        })
    }
}

impl ShapeFile {
    /// Everything about the file that needs no daemon: it names its run, every
    /// provider kind is one this daemon drives, the shape is valid, and it
    /// asks for at least one node. Returns the shape at `generation` (the
    /// file's own generation wins).
    ///
    /// An empty shape is refused rather than taken to mean "remove
    /// everything": a truncated or half-written file must never tear a
    /// cluster down. `swactor down` is how to do that.
    ///
    /// # Errors
    /// The first of those that fails, in words that name the field; nothing
    /// was changed.
    pub(crate) fn check(&self, generation: u64) -> Result<ClusterShape> {
        if self.run.is_none() {
            bail!(
                "the shape names no run: add a top-level `run = \"NAME\"` (a daemon serves \
                 one run, and the name must match it); nothing was changed"
            );
        }
        let shape = self.to_shape(generation)?;
        let desired = shape.validate().map_err(|e| {
            anyhow::anyhow!(
                "the shape is invalid: {}; nothing was changed",
                shape_error(&e)
            )
        })?;
        // The spend cap is the run's: every vast group that names one must
        // name the same.
        let mut spend_cap: Option<(f64, String)> = None;
        for g in &desired.groups {
            let checked = match g.template.provider.kind.as_str() {
                "ssh" => swactor_providers::ssh::check_template(&g.template),
                "docker" => swactor_providers::docker::check_template(&g.template),
                "vast" => swactor_providers::vast::check_template(&g.template),
                _ => Ok(()),
            };
            checked.map_err(|e| {
                anyhow::anyhow!("group {}: {e}; nothing was changed", cut(g.id.as_str()))
            })?;
            if g.template.provider.kind == "vast"
                && let Some(cap) = swactor_providers::vast::spend_cap_of(&g.template)
            {
                match &spend_cap {
                    Some((first, by)) if (first - cap).abs() > 1e-9 => bail!(
                        "group {} sets spend_cap_dph = {cap} but group {by} sets {first}: the cap \
                         covers the whole run, so every vast group that sets it must set the \
                         same value; nothing was changed",
                        cut(g.id.as_str())
                    ),
                    Some(_) => {}
                    None => spend_cap = Some((cap, cut(g.id.as_str()).to_string())),
                }
            }
        }
        if desired.node_count() == 0 {
            let why = if self.groups.is_empty() {
                "it declares no group"
            } else {
                "every group's count is 0"
            };
            bail!(
                "the shape asks for no nodes ({why}); it is refused so that an empty or \
                 truncated file never tears a cluster down. To remove every node, use \
                 `swactor down`. Nothing was changed"
            );
        }
        Ok(shape)
    }
}

/// The refusal, if `shape` (of `nodes` nodes) grows a cluster of `current`
/// nodes past the shape's own `capacity`; as the daemon decides, a shape may
/// always shrink.
pub(crate) fn over_own_capacity(shape: &ClusterShape, current: u64) -> Option<String> {
    let capacity = shape.capacity?;
    // Counted at the peak of a rollout: surge nodes are machines too.
    let (nodes, surge) = match shape.validate() {
        Ok(d) => (d.peak_node_count(), d.peak_node_count() - d.node_count()),
        Err(_) => (shape.node_count(), 0),
    };
    let with_surge = if surge > 0 {
        format!(" (counting up to {surge} surge node(s) of a rollout)")
    } else {
        String::new()
    };
    (nodes > capacity && nodes > current).then(|| {
        format!(
            "the shape asks for {nodes} nodes{with_surge}, more than its own `capacity` of \
             {capacity}; nothing was changed"
        )
    })
}

/// A shape error in words, with any value it echoes cut to a readable length.
pub(crate) fn shape_error(e: &ShapeError) -> String {
    match e {
        ShapeError::RunId { value, source } => format!("run {:?} {source}", cut(value)),
        ShapeError::GroupId {
            index,
            value,
            source,
        } => format!("groups[{index}].id {:?} {source}", cut(value)),
        ShapeError::DuplicateGroup { index, first, id } => {
            format!(
                "groups[{index}].id {:?} is already used by groups[{first}]",
                cut(id)
            )
        }
        other => crate::words::cut_long_words(&other.to_string()),
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_file_parses_with_an_optional_generation() {
        let f = ShapeFile::parse(
            "run = \"demo\"\n[[group]]\nid = \"worker\"\ncount = 3\nprovider = \"process\"\n",
            "x.toml",
        )
        .unwrap();
        assert_eq!(f.generation, None);
        let shape = f.to_shape(7).unwrap();
        assert_eq!(shape.generation, Generation(7));
        assert_eq!(shape.run_id, RunId::new("demo"));
        assert_eq!(shape.validate().unwrap().node_count(), 3);
    }

    #[test]
    fn malformed_toml_names_the_line_and_column() {
        let e = ShapeFile::parse("[[group]]\nid = \"w\"\ncount = three\n", "bad.toml").unwrap_err();
        assert!(e.to_string().starts_with("bad.toml:3:9:"), "{e}");
        let e = ShapeFile::parse("[[group]]\nid = \"w\"\ncuont = 3\n", "typo.toml").unwrap_err();
        assert!(e.to_string().contains("typo.toml:3:1"), "{e}");
        assert!(e.to_string().contains("cuont"), "{e}");
    }

    #[test]
    fn budgets_reach_the_shape_and_survive_the_journals_json() {
        let file = ShapeFile::parse(
            "run = \"r\"\n[[group]]\nid = \"w\"\ncount = 6\nprovider = \"process\"\nmax_unavailable = \"50%\"\nmax_unhealthy = 2\n",
            "x",
        )
        .unwrap();
        let shape = file.check(1).unwrap();
        let policy = shape.groups[0].policy;
        assert_eq!(policy.max_unavailable, Some(Quantity::Percent(50)));
        assert_eq!(policy.max_unhealthy, Some(Quantity::Count(2)));
        assert_eq!(policy.max_surge, None);
        // The journal keeps the shape as JSON; a shape without budgets
        // (as journals written before them hold) reads back with none.
        let json = serde_json::to_string(&shape).unwrap();
        assert!(json.contains("\"max_unavailable\":\"50%\""), "{json}");
        let back: ClusterShape = serde_json::from_str(&json).unwrap();
        assert_eq!(back, shape);
        let mut plain = shape.clone();
        plain.groups[0].policy = PolicyShape::default();
        let json = serde_json::to_string(&plain).unwrap();
        assert!(!json.contains("max_"), "{json}");
        assert_eq!(serde_json::from_str::<ClusterShape>(&json).unwrap(), plain);
    }

    #[test]
    fn a_shape_without_a_run_or_without_nodes_is_refused_and_names_down() {
        let no_run = ShapeFile::parse(
            "[[group]]\nid = \"w\"\ncount = 1\nprovider = \"process\"\n",
            "x",
        )
        .unwrap();
        let e = no_run.check(1).unwrap_err().to_string();
        assert!(e.contains("names no run"), "{e}");
        for body in [
            "run = \"r\"\n",
            "run = \"r\"\n[[group]]\nid = \"w\"\ncount = 0\nprovider = \"process\"\n",
        ] {
            let e = ShapeFile::parse(body, "x")
                .unwrap()
                .check(1)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("no nodes") && e.contains("`swactor down`"),
                "{e}"
            );
        }
        let ok = ShapeFile::parse(
            "run = \"r\"\n[[group]]\nid = \"w\"\ncount = 2\nprovider = \"process\"\n",
            "x",
        )
        .unwrap();
        assert_eq!(ok.check(1).unwrap().node_count(), 2);
    }

    #[test]
    fn a_long_id_in_a_shape_is_cut_in_the_error() {
        let long = "a".repeat(5_000);
        let f = ShapeFile::parse(
            &format!(
                "run = \"{long}\"\n[[group]]\nid = \"w\"\ncount = 1\nprovider = \"process\"\n"
            ),
            "x",
        )
        .unwrap();
        let e = f.check(1).unwrap_err().to_string();
        assert!(e.contains("(5000 characters)") && e.len() < 300, "{e}");
    }

    #[test]
    fn own_capacity_refuses_growth_only() {
        let f = ShapeFile::parse(
            "run = \"r\"\ncapacity = 5\n[[group]]\nid = \"w\"\ncount = 8\nprovider = \"process\"\n",
            "x",
        )
        .unwrap();
        let shape = f.check(1).unwrap();
        let e = over_own_capacity(&shape, 0).unwrap();
        assert!(
            e.contains("8 nodes") && e.contains("`capacity` of 5"),
            "{e}"
        );
        assert_eq!(over_own_capacity(&shape, 10), None, "shrinking from 10");
    }

    #[test]
    fn vast_groups_are_checked_and_must_agree_on_the_spend_cap() {
        let group = |id: &str, params: &str| {
            format!(
                "[[group]]\nid = \"{id}\"\ncount = 1\nprovider = \"vast\"\nimage = \"img\"\n\
                 [group.params]\n{params}\n"
            )
        };
        let check = |body: String| {
            ShapeFile::parse(&format!("run = \"r\"\n{body}"), "x")
                .unwrap()
                .check(1)
        };
        check(group("a", "max_dph = 0.5\nspend_cap_dph = 2.0")).unwrap();
        let e = check(group("a", "max_dph = 0")).unwrap_err().to_string();
        assert!(
            e.contains("group a") && e.contains("`max_dph` must be more than 0"),
            "{e}"
        );
        let e = check(group("a", "max_dph = 1.0\nnum_gpu = 2"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown parameter `num_gpu`"), "{e}");
        let two = format!(
            "{}{}",
            group("a", "max_dph = 0.5\nspend_cap_dph = 2.0"),
            group("b", "max_dph = 0.5\nspend_cap_dph = 3.0")
        );
        let e = check(two).unwrap_err().to_string();
        assert!(e.contains("spend_cap_dph = 3 but group a sets 2"), "{e}");
    }

    #[test]
    fn an_unknown_provider_kind_is_refused() {
        let f = ShapeFile::parse(
            "[[group]]\nid = \"g\"\ncount = 1\nprovider = \"aws\"\n",
            "x",
        )
        .unwrap();
        let e = f.to_shape(1).unwrap_err();
        assert!(e.to_string().contains("\"aws\""), "{e}");
        assert!(e.to_string().contains("supported: process"), "{e}");
    }
}
