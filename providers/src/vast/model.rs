//! What the vast provider decides without any I/O: a group's parameters,
//! instance labels, the offer query, how answers and errors are read, and
//! the spend cap.
//!
//! Everything here is a function of its arguments (time included), so the
//! unit tests below feed it bodies shaped like the real service's.
//!
//! Over 1,000 lines in one file with its tests: the code is under 1,000
//! lines; the rest are the unit tests of each pure decision, kept next to it.

use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::Duration;
use swactor_provisioning::{
    LogicalNodeId, NodeAttemptId, NodeTemplate, ParamValue, ResourceKey, RunId,
};

/// What every label the provider writes starts with.
pub(crate) const LABEL_PREFIX: &str = "swactor:";
/// What the labels of a recorded deployment start with, before its id.
pub(crate) const DEPLOYED_PREFIX: &str = "swactor/";
/// The longest label the service accepts.
pub(crate) const LABEL_LEN_MAX: usize = 256;
/// The smallest disk the service rents, in GB.
pub(crate) const DISK_GB_MIN: f64 = 8.0;
/// Default of [`GroupParams::disk_gb`].
pub(crate) const DISK_GB_DEFAULT: f64 = 16.0;
/// Default of [`GroupParams::load_timeout`]: image pulls on slow hosts take
/// minutes, and an instance stuck in `loading` bills all the while.
pub(crate) const LOAD_TIMEOUT_DEFAULT: Duration = Duration::from_secs(20 * 60);
/// How many offers one search asks for.
pub(crate) const OFFERS_LIMIT: u64 = 64;
/// The longest error text quoted from the service.
const MESSAGE_LEN_MAX: usize = 300;

/// The parameters a group may set (`[group.params]`).
pub const KNOWN_PARAMS: &[&str] = &[
    "gpu_name",
    "num_gpus",
    "min_gpu_ram_gb",
    "max_dph",
    "min_reliability",
    "disk_gb",
    "image",
    "region",
    "load_timeout_s",
    "spend_cap_dph",
    "verified",
    "external",
    "min_duration_h",
    "template_hash",
    "rental",
    "bid_dph",
    "ssh",
];

/// How the daemon reaches a group's machines over SSH (`ssh = "direct" | "proxy"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SshMode {
    /// The machine's public address and the host port mapped to the
    /// container's 22: only machines with open ports (`direct_port_count`)
    /// are rented, and only that endpoint is used. The default.
    Direct,
    /// The service's SSH proxy (`ssh_host`/`ssh_port`), which every
    /// instance has: machines without open ports are rented too. Every
    /// byte goes through the service's proxy host, a hop the service runs
    /// and may throttle.
    Proxy,
}

impl SshMode {
    /// The create's `runtype` that asks for this kind of SSH, as the
    /// official client sends it (`--ssh --direct`, `--ssh`).
    pub(crate) fn runtype(self) -> &'static str {
        match self {
            SshMode::Direct => "ssh_direc ssh_proxy",
            SshMode::Proxy => "ssh_proxy",
        }
    }

    /// The mode an instance was created with, read from its
    /// `image_runtype`: direct when it names `ssh_direc` (or the older
    /// `ssh_direct`), proxy when it names `ssh_proxy` alone; `None` when it
    /// names neither (a template's, or a row without the field).
    pub(crate) fn of_row(v: &Value) -> Option<Self> {
        let runtype = v.get("image_runtype").and_then(Value::as_str)?;
        let words = || runtype.split_whitespace();
        if words().any(|w| w == "ssh_direc" || w == "ssh_direct") {
            Some(SshMode::Direct)
        } else if words().any(|w| w == "ssh_proxy") {
            Some(SshMode::Proxy)
        } else {
            None
        }
    }
}

/// A group's offer query and limits, read from its template.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GroupParams {
    /// The GPU model, as the service names it (`RTX_4090`); any when absent.
    pub(crate) gpu_name: Option<String>,
    /// GPUs per machine.
    pub(crate) num_gpus: u32,
    /// Least GPU memory per GPU, in GB.
    pub(crate) min_gpu_ram_gb: Option<f64>,
    /// Most the group pays per machine and hour, in dollars (`dph_total`).
    pub(crate) max_dph: f64,
    /// Least host reliability (0 to 1).
    pub(crate) min_reliability: Option<f64>,
    /// Disk per machine, in GB.
    pub(crate) disk_gb: f64,
    /// The container image the machine runs.
    pub(crate) image: String,
    /// Countries or regions offers must be in (the service's `geolocation`).
    pub(crate) region: Vec<String>,
    /// How long an instance may stay short of `running` before it counts as failed.
    pub(crate) load_timeout: Duration,
    /// Most the whole run may cost per hour, in dollars.
    pub(crate) spend_cap_dph: Option<f64>,
    /// Only hosts the service has verified.
    pub(crate) verified: bool,
    /// Also offers of external (unmanaged, usually datacenter-resold)
    /// machines; off by default, as the official client's searches do.
    pub(crate) external: bool,
    /// Least time the offer's machine must still be rentable for, in hours
    /// (its `duration`, which the service gives in seconds).
    pub(crate) min_duration_h: Option<f64>,
    /// A template of the account's to create instances from (its hash).
    pub(crate) template_hash: Option<String>,
    /// `Some(bid)` for interruptible rentals (`rental = "interruptible"`):
    /// the price bid per machine and hour, storage aside. Another rental
    /// that bids more (or rents on demand) pauses the instance.
    pub(crate) bid_dph: Option<f64>,
    /// How the daemon reaches the machines: directly (machines with open
    /// ports only) or through the service's SSH proxy.
    pub(crate) ssh: SshMode,
}

fn number(name: &str, v: &ParamValue) -> Result<f64, String> {
    match v {
        ParamValue::Int(n) => Ok(*n as f64),
        ParamValue::Float(f) if f.is_finite() => Ok(*f),
        other => Err(format!("`{name}` must be a number, not {other}")),
    }
}

/// A group's `[group.params]`, by name.
type Params = BTreeMap<String, ParamValue>;

/// Refuses a parameter the provider does not know.
fn check_known(params: &Params) -> Result<(), String> {
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

/// The GPU model (`gpu_name`), trimmed; any when absent.
fn gpu_name(params: &Params) -> Result<Option<String>, String> {
    match params.get("gpu_name") {
        None => Ok(None),
        Some(ParamValue::Str(s)) if !s.trim().is_empty() => Ok(Some(s.trim().to_owned())),
        Some(other) => Err(format!(
            "`gpu_name` must be a GPU model such as \"RTX_4090\", not {other}"
        )),
    }
}

/// GPUs per machine (`num_gpus`), 1 to 64; 1 when absent.
fn num_gpus(params: &Params) -> Result<u32, String> {
    match params.get("num_gpus") {
        None => Ok(1),
        Some(ParamValue::Int(n)) if (1..=64).contains(n) => Ok(*n as u32),
        Some(other) => Err(format!("`num_gpus` must be 1 to 64, not {other}")),
    }
}

/// The number `name`, which must be more than 0 when present.
fn positive(params: &Params, name: &str) -> Result<Option<f64>, String> {
    match params.get(name) {
        None => Ok(None),
        Some(v) => {
            let n = number(name, v)?;
            if n > 0.0 {
                Ok(Some(n))
            } else {
                Err(format!("`{name}` must be more than 0, not {n}"))
            }
        }
    }
}

/// The least host reliability (`min_reliability`), 0 to 1.
fn min_reliability(params: &Params) -> Result<Option<f64>, String> {
    match params.get("min_reliability") {
        None => Ok(None),
        Some(v) => {
            let r = number("min_reliability", v)?;
            if !(0.0..=1.0).contains(&r) {
                return Err(format!("`min_reliability` must be 0 to 1, not {r}"));
            }
            Ok(Some(r))
        }
    }
}

/// Disk per machine (`disk_gb`), at least the service's minimum.
fn disk_gb(params: &Params) -> Result<f64, String> {
    let disk_gb = positive(params, "disk_gb")?.unwrap_or(DISK_GB_DEFAULT);
    if disk_gb < DISK_GB_MIN {
        return Err(format!(
            "`disk_gb` must be at least {DISK_GB_MIN} (the service's minimum), not {disk_gb}"
        ));
    }
    Ok(disk_gb)
}

/// The container image, named once by `params.image` or the group's `image`.
fn image(params: &Params, boot_image: Option<&str>) -> Result<String, String> {
    let image = match (params.get("image"), boot_image) {
        (Some(ParamValue::Str(s)), None) => s.clone(),
        (None, Some(s)) => s.to_owned(),
        (Some(ParamValue::Str(a)), Some(b)) if a == b => a.clone(),
        (Some(ParamValue::Str(_)), Some(_)) => {
            return Err(
                "the group names two different images (`image` and `params.image`); keep one"
                    .to_owned(),
            );
        }
        (Some(other), _) => return Err(format!("`image` must be a string, not {other}")),
        (None, None) => {
            return Err(
                "the group names no `image` (the container the machines run, e.g. \"pytorch/pytorch:latest\")"
                    .to_owned(),
            );
        }
    };
    if image.is_empty()
        || image.len() > 512
        || image.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "`image` {image:?} is not an image name (no spaces, at most 512 characters)"
        ));
    }
    Ok(image)
}

/// The regions offers must be in (`region`: one string or a list).
fn regions(params: &Params) -> Result<Vec<String>, String> {
    match params.get("region") {
        None => Ok(Vec::new()),
        Some(ParamValue::Str(s)) if !s.trim().is_empty() => Ok(vec![s.trim().to_owned()]),
        Some(ParamValue::List(l)) if !l.is_empty() => l
            .iter()
            .map(|v| match v {
                ParamValue::Str(s) if !s.trim().is_empty() => Ok(s.trim().to_owned()),
                other => Err(format!("every `region` must be a string, not {other}")),
            })
            .collect(),
        Some(other) => Err(format!(
            "`region` must be a string or a list of strings, not {other}"
        )),
    }
}

/// How long an instance may load (`load_timeout_s`), at most a week.
fn load_timeout(params: &Params) -> Result<Duration, String> {
    match positive(params, "load_timeout_s")? {
        None => Ok(LOAD_TIMEOUT_DEFAULT),
        Some(s) if s <= 7.0 * 24.0 * 3600.0 => Ok(Duration::from_secs_f64(s)),
        Some(s) => Err(format!("`load_timeout_s` must be at most a week, not {s}")),
    }
}

/// The boolean `name`, `default` when absent.
fn flag(params: &Params, name: &str, default: bool) -> Result<bool, String> {
    match params.get(name) {
        None => Ok(default),
        Some(ParamValue::Bool(b)) => Ok(*b),
        Some(other) => Err(format!("`{name}` must be true or false, not {other}")),
    }
}

/// The account's template to create from (`template_hash`), letters and digits.
fn template_hash(params: &Params) -> Result<Option<String>, String> {
    match params.get("template_hash") {
        None => Ok(None),
        Some(ParamValue::Str(s))
            if !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_alphanumeric()) =>
        {
            Ok(Some(s.clone()))
        }
        Some(other) => Err(format!(
            "`template_hash` must be a template's hash (letters and digits), not {other}"
        )),
    }
}

/// The bid of an interruptible rental (`rental`, `bid_dph`), within `max_dph`.
fn bid_dph(params: &Params, max_dph: f64) -> Result<Option<f64>, String> {
    match params.get("rental") {
        None => Ok(None),
        Some(ParamValue::Str(r)) if r == "on-demand" => Ok(None),
        Some(ParamValue::Str(r)) if r == "interruptible" => {
            let bid = positive(params, "bid_dph")?.ok_or_else(|| {
                "`rental = \"interruptible\"` needs `bid_dph`, the price to bid per machine \
                 and hour"
                    .to_owned()
            })?;
            if bid > max_dph {
                return Err(format!(
                    "`bid_dph` ({bid}) is over `max_dph` ({max_dph}): the bid is what a machine \
                     costs, storage aside"
                ));
            }
            Ok(Some(bid))
        }
        Some(other) => Err(format!(
            "`rental` is \"on-demand\" (the default) or \"interruptible\", not {other}"
        )),
    }
}

/// How the daemon reaches the machines (`ssh`); direct when absent.
fn ssh_mode(params: &Params) -> Result<SshMode, String> {
    match params.get("ssh") {
        None => Ok(SshMode::Direct),
        Some(ParamValue::Str(m)) if m == "direct" => Ok(SshMode::Direct),
        Some(ParamValue::Str(m)) if m == "proxy" => Ok(SshMode::Proxy),
        Some(other) => Err(format!(
            "`ssh` is \"direct\" (the default: machines with open ports, reached on them) \
             or \"proxy\" (any machine, reached through the service's SSH proxy), not {other}"
        )),
    }
}

/// Refuses a `bid_dph` without a bid rental, and a spend cap below `max_dph`.
fn check_rental_limits(
    params: &Params,
    bid_dph: Option<f64>,
    spend_cap_dph: Option<f64>,
    max_dph: f64,
) -> Result<(), String> {
    if bid_dph.is_none() && params.contains_key("bid_dph") {
        return Err("`bid_dph` is for `rental = \"interruptible\"` only".to_owned());
    }
    if let Some(cap) = spend_cap_dph
        && cap < max_dph
    {
        return Err(format!(
            "`spend_cap_dph` ({cap}) is below `max_dph` ({max_dph}): no machine could ever be rented"
        ));
    }
    Ok(())
}

impl GroupParams {
    /// The group's parameters, checked.
    ///
    /// # Errors
    /// The first problem, worded for the shape's author.
    pub(crate) fn of(template: &NodeTemplate) -> Result<Self, String> {
        let params = &template.provider.params;
        check_known(params)?;
        let gpu_name = gpu_name(params)?;
        let num_gpus = num_gpus(params)?;
        let max_dph = positive(params, "max_dph")?.ok_or_else(|| {
            "`max_dph` (the most a machine may cost per hour, in dollars) is required".to_owned()
        })?;
        let min_gpu_ram_gb = positive(params, "min_gpu_ram_gb")?;
        let min_reliability = min_reliability(params)?;
        let disk_gb = disk_gb(params)?;
        let image = image(params, template.boot.image.as_deref())?;
        let region = regions(params)?;
        let load_timeout = load_timeout(params)?;
        let spend_cap_dph = positive(params, "spend_cap_dph")?;
        let verified = flag(params, "verified", true)?;
        let external = flag(params, "external", false)?;
        let min_duration_h = positive(params, "min_duration_h")?;
        let template_hash = template_hash(params)?;
        let bid_dph = bid_dph(params, max_dph)?;
        let ssh = ssh_mode(params)?;
        check_rental_limits(params, bid_dph, spend_cap_dph, max_dph)?;
        Ok(Self {
            gpu_name,
            num_gpus,
            min_gpu_ram_gb,
            max_dph,
            min_reliability,
            disk_gb,
            image,
            region,
            load_timeout,
            spend_cap_dph,
            verified,
            external,
            min_duration_h,
            template_hash,
            bid_dph,
            ssh,
        })
    }

    /// Whether this group may rent `offer`: its rented price within
    /// `max_dph`, its region, and for a bid, a minimum bid the bid meets.
    pub(crate) fn can_win(&self, offer: &Offer) -> bool {
        let bid_ok = match (self.bid_dph, offer.min_bid) {
            (Some(bid), Some(min)) => min <= bid + 1e-9,
            _ => true,
        };
        bid_ok
            && self.rented_dph(offer) <= self.max_dph + 1e-9
            && self.in_region(&offer.geolocation)
    }

    /// What renting `offer` costs per hour with this group's rental: its
    /// `dph_total` on demand; for a bid, the search priced it at its
    /// minimum bid (storage included), so the bid replaces that minimum.
    pub(crate) fn rented_dph(&self, offer: &Offer) -> f64 {
        match (self.bid_dph, offer.min_bid) {
            (None, _) => offer.dph_total,
            (Some(bid), Some(min)) => offer.dph_total - min + bid,
            (Some(bid), None) => offer.dph_total.max(bid),
        }
    }

    /// The body of `POST /bundles/`: rentable on-demand offers that fit,
    /// cheapest first. Prices are asked for with the group's disk
    /// (`allocated_storage`), so `dph_total` holds the storage the rental
    /// pays for, and `max_dph` and the spend cap count it. With direct SSH
    /// (the default), only machines with open ports (`direct_port_count`):
    /// a machine without one could never serve the daemon while it bills.
    /// Through the proxy, any machine: every instance has a proxy endpoint.
    pub(crate) fn offer_query(&self) -> Value {
        let mut q = json!({
            "rentable": {"eq": true},
            "rented": {"eq": false},
            "num_gpus": {"eq": self.num_gpus},
            "dph_total": {"lte": self.max_dph},
            "disk_space": {"gte": self.disk_gb},
            "allocated_storage": self.disk_gb,
            "order": [["dph_total", "asc"]],
            "type": "on-demand",
            "limit": OFFERS_LIMIT,
        });
        if self.ssh == SshMode::Direct {
            q["direct_port_count"] = json!({"gte": 1});
        }
        if self.bid_dph.is_some() {
            // Offers priced at their minimum bid; those this bid cannot win
            // are left out once listed (see [`Self::can_win`]).
            q["type"] = json!("bid");
        }
        if !self.external {
            q["external"] = json!({"eq": false});
        }
        if let Some(h) = self.min_duration_h {
            q["duration"] = json!({"gte": h * 3600.0});
        }
        if self.verified {
            q["verified"] = json!({"eq": true});
        }
        if let Some(name) = &self.gpu_name {
            q["gpu_name"] = json!({"eq": name});
        }
        if let Some(gb) = self.min_gpu_ram_gb {
            // The service counts GPU memory in MB.
            q["gpu_ram"] = json!({"gte": gb * 1000.0});
        }
        if let Some(r) = self.min_reliability {
            q["reliability2"] = json!({"gte": r});
        }
        // The region is matched here ([`GroupParams::in_region`]), not by the
        // service: its `geolocation` reads "Sweden, SE", and how it matches a
        // bare country code is not documented.
        q
    }

    /// Whether an offer at `geolocation` ("Sweden, SE") is in one of the
    /// group's regions: a region matches the whole text or one of its
    /// comma-separated parts, ignoring case.
    pub(crate) fn in_region(&self, geolocation: &str) -> bool {
        self.region.is_empty()
            || self.region.iter().any(|r| {
                geolocation.trim().eq_ignore_ascii_case(r)
                    || geolocation
                        .split(',')
                        .any(|part| part.trim().eq_ignore_ascii_case(r))
            })
    }

    /// The query in words, for messages.
    pub(crate) fn describe(&self) -> String {
        let mut parts = vec![format!("{} GPU(s)", self.num_gpus)];
        if let Some(n) = &self.gpu_name {
            parts.push(n.clone());
        }
        if let Some(gb) = self.min_gpu_ram_gb {
            parts.push(format!("≥ {gb} GB GPU RAM"));
        }
        parts.push(format!("≤ {:.3} $/h", self.max_dph));
        if let Some(r) = self.min_reliability {
            parts.push(format!("reliability ≥ {r}"));
        }
        parts.push(format!("disk ≥ {} GB", self.disk_gb));
        if !self.region.is_empty() {
            parts.push(format!("in {}", self.region.join("/")));
        }
        if self.verified {
            parts.push("verified hosts".to_owned());
        }
        if let Some(h) = self.min_duration_h {
            parts.push(format!("rentable for ≥ {h} h"));
        }
        parts.push(match self.ssh {
            SshMode::Direct => "with open ports".to_owned(),
            SshMode::Proxy => "reached through the SSH proxy".to_owned(),
        });
        if !self.external {
            parts.push("not external".to_owned());
        }
        parts.join(", ")
    }
}

/// The label of `key`'s instance: `swactor/{deployment}:{run}:{node}:{attempt}`,
/// or `swactor:{run}:{node}:{attempt}` for a deployment made before they
/// were recorded.
pub(crate) fn label_of(key: &ResourceKey, deployment: Option<&str>) -> String {
    match deployment {
        Some(d) => format!(
            "{DEPLOYED_PREFIX}{d}:{}:{}:{}",
            key.run_id, key.node, key.attempt.0
        ),
        None => format!(
            "{LABEL_PREFIX}{}:{}:{}",
            key.run_id, key.node, key.attempt.0
        ),
    }
}

/// The key a label names and the deployment it carries (`None`: none), if
/// it is one of ours.
pub(crate) fn parse_label(label: &str) -> Option<(ResourceKey, Option<&str>)> {
    let (deployment, rest) = match label.strip_prefix(DEPLOYED_PREFIX) {
        Some(rest) => {
            let (d, rest) = rest.split_once(':')?;
            if d.is_empty() {
                return None;
            }
            (Some(d), rest)
        }
        None => (None, label.strip_prefix(LABEL_PREFIX)?),
    };
    // From the right: the run id may hold anything a shape allows.
    let (rest, attempt) = rest.rsplit_once(':')?;
    let (run, node) = rest.rsplit_once(':')?;
    if run.is_empty() || attempt.is_empty() || !attempt.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let key = ResourceKey {
        run_id: RunId::new(run),
        node: LogicalNodeId::parse(node)?,
        attempt: NodeAttemptId(attempt.parse().ok()?),
    };
    Some((key, deployment))
}

/// One offer from a search.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Offer {
    /// The ask id a create names.
    pub(crate) id: u64,
    /// The machine it is on.
    pub(crate) machine_id: u64,
    /// Dollars per hour, all included.
    pub(crate) dph_total: f64,
    /// The GPU model.
    pub(crate) gpu_name: String,
    /// GPUs.
    pub(crate) num_gpus: u64,
    /// Where the machine is.
    pub(crate) geolocation: String,
    /// The least bid it takes, when the service says.
    pub(crate) min_bid: Option<f64>,
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| *f >= 0.0 && f.fract() == 0.0)
                .map(|f| f as u64)
        }),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
    .filter(|f: &f64| f.is_finite())
}

fn as_str(v: &Value) -> Option<&str> {
    v.as_str()
}

/// The offers of a search answer, cheapest first; offers missing an id or
/// a price are skipped.
///
/// # Errors
/// The answer has no `offers` list.
pub(crate) fn parse_offers(body: &Value) -> Result<Vec<Offer>, String> {
    let list = body
        .get("offers")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            format!(
                "the offer search answered without an `offers` list: {}",
                quote_body(body)
            )
        })?;
    let mut offers: Vec<Offer> = list
        .iter()
        .filter_map(|o| {
            Some(Offer {
                id: as_u64(o.get("id")?)?,
                machine_id: o.get("machine_id").and_then(as_u64).unwrap_or(0),
                dph_total: as_f64(o.get("dph_total")?)?,
                gpu_name: o.get("gpu_name").and_then(as_str).unwrap_or("?").to_owned(),
                num_gpus: o.get("num_gpus").and_then(as_u64).unwrap_or(0),
                geolocation: o
                    .get("geolocation")
                    .and_then(as_str)
                    .unwrap_or("")
                    .to_owned(),
                min_bid: o.get("min_bid").and_then(as_f64),
            })
        })
        .collect();
    offers.sort_by(|a, b| a.dph_total.total_cmp(&b.dph_total).then(a.id.cmp(&b.id)));
    Ok(offers)
}

/// The instance id a successful create answered.
///
/// # Errors
/// The answer does not say `success` with a `new_contract`.
pub(crate) fn parse_created(body: &Value) -> Result<u64, String> {
    if body.get("success").and_then(Value::as_bool) == Some(false) {
        return Err(format!(
            "the create answered success=false: {}",
            message_of(body)
        ));
    }
    body.get("new_contract").and_then(as_u64).ok_or_else(|| {
        format!(
            "the create answered no `new_contract`: {}",
            quote_body(body)
        )
    })
}

/// One instance, as listed or shown.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Instance {
    /// The instance (contract) id.
    pub(crate) id: u64,
    /// `null` (being set up), `loading`, `running`, `exited`, ...
    pub(crate) actual_status: Option<String>,
    /// What the owner asked for (`running`, `stopped`).
    pub(crate) intended_status: Option<String>,
    /// Its label.
    pub(crate) label: Option<String>,
    /// The service's last word on it.
    pub(crate) status_msg: Option<String>,
    /// The SSH endpoint, once it has one: the one its `image_runtype`
    /// asks for (see [`SshMode::of_row`] and [`ssh_endpoint_for`]), else
    /// the direct port, else the proxy ([`ssh_endpoint`]).
    pub(crate) ssh: Option<(String, u16)>,
    /// The machine it runs on.
    pub(crate) machine_id: Option<u64>,
    /// Dollars per hour.
    pub(crate) dph_total: Option<f64>,
    /// Rented at a bid (interruptible): another rental may pause it.
    pub(crate) is_bid: bool,
    /// When its contract ends (seconds since the Unix epoch), if it does.
    pub(crate) end_date: Option<f64>,
}

/// The SSH endpoint of an instance: the machine's public address with the
/// port mapped to the container's 22, else the service's SSH proxy.
pub(crate) fn ssh_endpoint(v: &Value) -> Option<(String, u16)> {
    direct_endpoint(v).or_else(|| proxy_endpoint(v))
}

/// The SSH endpoint of an instance for `mode`, and no other: the direct
/// one ([`direct_endpoint`]) or the proxy ([`proxy_endpoint`]).
pub(crate) fn ssh_endpoint_for(v: &Value, mode: SshMode) -> Option<(String, u16)> {
    match mode {
        SshMode::Direct => direct_endpoint(v),
        SshMode::Proxy => proxy_endpoint(v),
    }
}

/// The machine's public address and the host port mapped to the
/// container's 22 (`ports["22/tcp"]`), which only a machine with open
/// ports has.
pub(crate) fn direct_endpoint(v: &Value) -> Option<(String, u16)> {
    let ip = v.get("public_ipaddr").and_then(as_str)?.trim();
    let port = v
        .get("ports")?
        .get("22/tcp")?
        .as_array()?
        .first()?
        .get("HostPort")?;
    let port = u16::try_from(as_u64(port)?).ok()?;
    (!ip.is_empty() && port != 0).then(|| (ip.to_owned(), port))
}

/// The service's SSH proxy for the instance (`ssh_host`/`ssh_port`).
pub(crate) fn proxy_endpoint(v: &Value) -> Option<(String, u16)> {
    let host = v.get("ssh_host").and_then(as_str)?.trim();
    let port = u16::try_from(as_u64(v.get("ssh_port")?)?).ok()?;
    (!host.is_empty() && port != 0).then(|| (host.to_owned(), port))
}

/// One instance from its JSON object; `None` without an id.
pub(crate) fn parse_instance(v: &Value) -> Option<Instance> {
    let s = |name: &str| v.get(name).and_then(as_str).map(str::to_owned);
    Some(Instance {
        id: as_u64(v.get("id")?)?,
        actual_status: s("actual_status"),
        intended_status: s("intended_status"),
        label: s("label"),
        status_msg: s("status_msg"),
        ssh: match SshMode::of_row(v) {
            Some(mode) => ssh_endpoint_for(v, mode),
            None => ssh_endpoint(v),
        },
        machine_id: v.get("machine_id").and_then(as_u64),
        dph_total: v.get("dph_total").and_then(as_f64),
        is_bid: v.get("is_bid").and_then(Value::as_bool).unwrap_or(false),
        end_date: v.get("end_date").and_then(as_f64),
    })
}

/// A page of an instance listing (v0 or v1): the instances and the token
/// of the next page (`None` on the last).
///
/// # Errors
/// The answer has no `instances` list.
pub(crate) fn parse_instance_page(body: &Value) -> Result<(Vec<Instance>, Option<String>), String> {
    let list = match body.get("instances") {
        Some(Value::Array(list)) => list,
        Some(Value::Null) => return Ok((Vec::new(), None)),
        _ => {
            return Err(format!(
                "the instance listing answered without an `instances` list: {}",
                quote_body(body)
            ));
        }
    };
    let next = match body.get("next_token") {
        Some(Value::String(t)) if !t.is_empty() => Some(t.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    };
    Ok((list.iter().filter_map(parse_instance).collect(), next))
}

/// The instance of a `show` answer: `None` for `"instances": null` (no such
/// instance).
///
/// # Errors
/// Neither an instance object nor null.
pub(crate) fn parse_shown(body: &Value) -> Result<Option<Instance>, String> {
    match body.get("instances") {
        Some(Value::Null) => Ok(None),
        Some(v @ Value::Object(_)) => parse_instance(v)
            .map(Some)
            .ok_or_else(|| format!("the instance shown has no id: {}", quote_body(body))),
        // Some versions answer a one-element list.
        Some(Value::Array(l)) if l.len() <= 1 => Ok(l.first().and_then(parse_instance)),
        _ => Err(format!(
            "the instance show answered without an `instances` object: {}",
            quote_body(body)
        )),
    }
}

/// Where an instance is on its way to serving.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Health {
    /// Still being set up (`null`, `loading`, `created`, a running one
    /// without an SSH port yet): the status, for messages.
    Pending(String),
    /// Running, with this SSH endpoint.
    Running(String, u16),
    /// It will never serve (`exited`, `offline`, `unknown`, a failed boot,
    /// stopped): why, in words.
    Failed(String),
    /// Destroyed.
    Destroyed,
}

/// What the service's view of `i` means for its node.
pub(crate) fn health(i: &Instance) -> Health {
    let msg = i
        .status_msg
        .as_deref()
        .map(str::trim)
        .filter(|m| !m.is_empty());
    let failed = |what: &str| {
        let mut text = format!("instance {} is {what}", i.id);
        if let Some(m) = i.machine_id {
            text.push_str(&format!(" on machine {m}"));
        }
        if let Some(msg) = msg {
            text.push_str(&format!(": {}", cut(msg)));
        }
        Health::Failed(text)
    };
    let status = i.actual_status.as_deref().map(str::trim).unwrap_or("");
    if matches!(i.intended_status.as_deref(), Some("stopped")) && status != "destroyed" {
        return failed("stopped (its intended status is `stopped`)");
    }
    match status {
        "" | "loading" | "scheduling" | "creating" | "provisioning" => {
            Health::Pending(if status.is_empty() {
                "being set up".to_owned()
            } else {
                status.to_owned()
            })
        }
        "created" if msg.is_some_and(|m| m.contains("OCI runtime create failed")) => {
            failed("a failed boot (the container never started)")
        }
        "created" => Health::Pending("created".to_owned()),
        "running" => match &i.ssh {
            Some((host, port)) => Health::Running(host.clone(), *port),
            None => Health::Pending("running, without an SSH port yet".to_owned()),
        },
        // Frozen: the machine holds the GPU (and bills for it) but runs nothing.
        "exited" | "offline" | "unknown" | "stopped" | "inactive" | "frozen" => failed(status),
        // A reboot comes back by itself, on the same machine.
        "rebooting" | "restarting" => Health::Pending(status.to_owned()),
        "destroyed" | "deleted" => Health::Destroyed,
        other => Health::Pending(format!("in the state {:?}", cut(other))),
    }
}

/// How a create failed, for the provider's next move.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum CreateFailure {
    /// The offer cannot be rented (gone, already rented): nothing was
    /// rented; the next create uses another offer, not on this machine.
    Capacity(String),
    /// The request was refused as it stands (a bad image, a bad argument):
    /// nothing was rented, and the same create will fail again.
    Refused(String),
    /// The API key was refused.
    Auth(String),
    /// Too many requests: nothing was rented; try later.
    RateLimited(String),
    /// The service failed while handling it: it may have rented.
    Unknown(String),
}

/// The words of an error body: its `msg`, `error` or `detail`, else its text.
pub(crate) fn message_of(body: &Value) -> String {
    for field in ["msg", "detail", "error", "message"] {
        if let Some(s) = body
            .get(field)
            .and_then(as_str)
            .filter(|s| !s.trim().is_empty())
        {
            return cut(s.trim());
        }
    }
    quote_body(body)
}

/// The words of an answer body, JSON or not.
pub(crate) fn message_of_text(text: &str) -> String {
    match serde_json::from_str::<Value>(text) {
        Ok(v @ Value::Object(_)) => message_of(&v),
        _ => cut(text.trim()),
    }
}

fn quote_body(body: &Value) -> String {
    cut(&body.to_string())
}

/// `s`, cut to a readable length on a character boundary.
pub(crate) fn cut(s: &str) -> String {
    if s.chars().count() <= MESSAGE_LEN_MAX {
        s.to_owned()
    } else {
        let mut out: String = s.chars().take(MESSAGE_LEN_MAX).collect();
        out.push('…');
        out
    }
}

/// Whether an error text says the offer cannot be rented any more.
fn says_unavailable(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    [
        "no_such_ask",
        "3603",
        "not available",
        "no longer available",
        "unavailable",
        "already rented",
        "not rentable",
        "no longer rentable",
    ]
    .iter()
    .any(|w| t.contains(w))
}

/// How a create that the service answered with `status` and `body` failed.
pub(crate) fn classify_create(status: u16, body: &str) -> CreateFailure {
    let msg = message_of_text(body);
    let with_code = |m: &str| format!("{m} (HTTP {status})");
    match status {
        429 => CreateFailure::RateLimited(with_code(&msg)),
        401 | 403 => CreateFailure::Auth(with_code(&msg)),
        404 | 410 => CreateFailure::Capacity(with_code(&msg)),
        400..=499 if says_unavailable(body) => CreateFailure::Capacity(with_code(&msg)),
        400..=499 => CreateFailure::Refused(with_code(&msg)),
        _ => CreateFailure::Unknown(with_code(&msg)),
    }
}

/// Whether a destroy answered with `status` and `body` means the instance
/// is absent (which a destroy counts as done).
pub(crate) fn destroy_absent(status: u16, body: &str) -> bool {
    if status == 404 {
        return true;
    }
    let t = body.to_ascii_lowercase();
    (200..300).contains(&status) && (t.contains("not_found") || t.contains("no_such_instance"))
}

/// What the run costs per hour and whether another `offer_dph` fits under
/// `cap`. `live` is the cost of every live instance of the run.
///
/// # Errors
/// The refusal, with the numbers.
pub(crate) fn check_spend(cap: f64, live: &[f64], offer_dph: f64) -> Result<f64, String> {
    let now: f64 = live.iter().sum();
    let after = now + offer_dph;
    // A cent's hundredth of slack: prices are decimal, sums are binary.
    if after > cap + 1e-6 {
        Err(format!(
            "the spend cap is {cap:.3} $/h: the run's {} live instance(s) cost {now:.3} $/h and the cheapest fitting offer {offer_dph:.3} $/h, {after:.3} $/h in all; nothing was rented",
            live.len()
        ))
    } else {
        Ok(after)
    }
}

/// The wait before the `failures`-th retry (1-based) of a rate-limited or
/// failed request: doubling from `base`, at most `cap`.
pub(crate) fn backoff(failures: u32, base: Duration, cap: Duration) -> Duration {
    let shift = failures.saturating_sub(1).min(20);
    base.saturating_mul(1u32 << shift).min(cap)
}

/// The secret is replaced wherever it shows in `text`.
pub(crate) fn redact(text: &str, secret: &str) -> String {
    if secret.len() < 4 {
        return text.to_owned();
    }
    text.replace(secret, "[redacted]")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use swactor_provisioning::{BootParams, GroupId, NodeLimits, ProviderShape, SwarmJoin};

    fn template(params: &[(&str, ParamValue)], image: Option<&str>) -> NodeTemplate {
        NodeTemplate {
            provider: ProviderShape {
                kind: "vast".into(),
                params: params
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), v.clone()))
                    .collect::<BTreeMap<_, _>>(),
                placement: BTreeMap::new(),
            },
            boot: BootParams {
                image: image.map(str::to_owned),
                ..BootParams::default()
            },
            role: "worker".into(),
            join: SwarmJoin::default(),
            limits: NodeLimits::default(),
        }
    }

    fn key() -> ResourceKey {
        ResourceKey {
            run_id: RunId::new("train:1"),
            node: LogicalNodeId::new(GroupId::new("gpu"), 3),
            attempt: NodeAttemptId(17),
        }
    }

    #[test]
    fn a_label_names_its_key_and_deployment_and_parses_back_even_with_colons_in_the_run() {
        let label = label_of(&key(), None);
        assert_eq!(label, "swactor:train:1:gpu-3:17");
        assert_eq!(parse_label(&label), Some((key(), None)));
        let label = label_of(&key(), Some("0a1b2c3d"));
        assert_eq!(label, "swactor/0a1b2c3d:train:1:gpu-3:17");
        assert_eq!(parse_label(&label), Some((key(), Some("0a1b2c3d"))));
        for bad in [
            "",
            "swactor:",
            "swactor:r:gpu-3",
            "swactor:r:gpu-3:x",
            "swactor::gpu-3:1",
            "swactor:r:gpu:1",
            "swactor/:r:gpu-3:1",
            "swactor/d:r:gpu-3",
            "someone else's label",
        ] {
            assert_eq!(parse_label(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_run_never_matches_another_run_that_extends_its_name() {
        let other = ResourceKey {
            run_id: RunId::new("train2"),
            ..key()
        };
        let (parsed, _) = parse_label(&label_of(&other, Some("0a1b2c3d"))).unwrap();
        assert_ne!(parsed.run_id, RunId::new("train"));
    }

    #[test]
    fn group_params_are_read_with_defaults_and_bad_values_are_refused_in_words() {
        let p = GroupParams::of(&template(
            &[
                ("gpu_name", ParamValue::Str("RTX_4090".into())),
                ("max_dph", ParamValue::Float(0.5)),
                (
                    "region",
                    ParamValue::List(vec![ParamValue::Str("US".into())]),
                ),
            ],
            Some("pytorch/pytorch:latest"),
        ))
        .unwrap();
        assert_eq!(p.num_gpus, 1);
        assert_eq!(p.disk_gb, DISK_GB_DEFAULT);
        assert_eq!(p.load_timeout, LOAD_TIMEOUT_DEFAULT);
        assert!(p.verified);
        let q = p.offer_query();
        assert_eq!(q["gpu_name"], json!({"eq": "RTX_4090"}));
        assert_eq!(q["dph_total"], json!({"lte": 0.5}));
        assert_eq!(q["rented"], json!({"eq": false}));
        assert!(q.get("geolocation").is_none());
        assert!(p.in_region("United States, US"));
        assert!(p.in_region("us"));
        assert!(!p.in_region("Sweden, SE"));
        assert!(!p.in_region("USA-ish"));
        assert_eq!(q["order"], json!([["dph_total", "asc"]]));
        // Renting right: open ports, no external machines, storage priced in.
        assert_eq!(q["direct_port_count"], json!({"gte": 1}));
        assert_eq!(q["external"], json!({"eq": false}));
        assert_eq!(q["allocated_storage"], json!(DISK_GB_DEFAULT));
        assert!(q.get("duration").is_none());
        let asked = GroupParams::of(&template(
            &[
                ("max_dph", ParamValue::Float(0.5)),
                ("external", ParamValue::Bool(true)),
                ("min_duration_h", ParamValue::Int(48)),
                ("template_hash", ParamValue::Str("abc123".into())),
            ],
            Some("img"),
        ))
        .unwrap();
        // A bid: searched at minimum bids, priced at its own.
        let bid = GroupParams::of(&template(
            &[
                ("max_dph", ParamValue::Float(0.5)),
                ("rental", ParamValue::Str("interruptible".into())),
                ("bid_dph", ParamValue::Float(0.3)),
            ],
            Some("img"),
        ))
        .unwrap();
        assert_eq!(bid.offer_query()["type"], json!("bid"));
        let offer = |dph_total: f64, min_bid: Option<f64>| Offer {
            id: 1,
            machine_id: 2,
            dph_total,
            gpu_name: "RTX 4090".into(),
            num_gpus: 1,
            geolocation: String::new(),
            min_bid,
        };
        // Minimum bid 0.2 plus 0.01 of storage: rented at 0.3 + 0.01.
        assert!((bid.rented_dph(&offer(0.21, Some(0.2))) - 0.31).abs() < 1e-9);
        assert!(bid.can_win(&offer(0.21, Some(0.2))));
        assert!(
            !bid.can_win(&offer(0.36, Some(0.35))),
            "a minimum over the bid"
        );
        assert_eq!(asked.rented_dph(&offer(0.4, Some(0.2))), 0.4, "on demand");
        let refused = |params: &[(&str, ParamValue)]| {
            GroupParams::of(&template(params, Some("img"))).unwrap_err()
        };
        let max = ("max_dph", ParamValue::Float(0.5));
        assert!(
            refused(&[
                max.clone(),
                ("rental", ParamValue::Str("interruptible".into()))
            ])
            .contains("needs `bid_dph`")
        );
        assert!(
            refused(&[
                max.clone(),
                ("rental", ParamValue::Str("interruptible".into())),
                ("bid_dph", ParamValue::Float(0.6))
            ])
            .contains("over `max_dph`")
        );
        assert!(
            refused(&[max.clone(), ("bid_dph", ParamValue::Float(0.1))]).contains("is for `rental")
        );
        assert!(
            refused(&[max, ("rental", ParamValue::Str("spot".into()))]).contains("not \"spot\"")
        );

        let q = asked.offer_query();
        assert!(q.get("external").is_none());
        assert_eq!(q["duration"], json!({"gte": 48.0 * 3600.0}));
        assert_eq!(asked.template_hash.as_deref(), Some("abc123"));
        assert!(asked.describe().contains("rentable for ≥ 48 h"));

        let err = |params: &[(&str, ParamValue)], image: Option<&str>| {
            GroupParams::of(&template(params, image)).unwrap_err()
        };
        let img = Some("img");
        assert!(err(&[], img).contains("`max_dph`"));
        assert!(err(&[("max_dph", ParamValue::Int(0))], img).contains("more than 0"));
        assert!(err(&[("max_dph", ParamValue::Float(-1.0))], img).contains("more than 0"));
        assert!(err(&[("max_dph", ParamValue::Int(1))], None).contains("no `image`"));
        assert!(err(&[("max_dph", ParamValue::Int(1))], Some("a b")).contains("not an image"));
        assert!(
            err(
                &[
                    ("max_dph", ParamValue::Int(1)),
                    ("disk_gb", ParamValue::Int(4))
                ],
                img
            )
            .contains("at least 8")
        );
        assert!(
            err(
                &[
                    ("max_dph", ParamValue::Int(1)),
                    ("gpus", ParamValue::Int(4))
                ],
                img
            )
            .contains("unknown parameter `gpus`")
        );
        assert!(
            err(
                &[
                    ("max_dph", ParamValue::Int(1)),
                    ("spend_cap_dph", ParamValue::Float(0.5))
                ],
                img
            )
            .contains("below `max_dph`")
        );
        assert!(
            err(
                &[
                    ("max_dph", ParamValue::Int(1)),
                    ("min_reliability", ParamValue::Float(1.5))
                ],
                img
            )
            .contains("0 to 1")
        );
    }

    #[test]
    fn offers_are_read_cheapest_first_and_broken_ones_skipped() {
        let body = json!({"offers": [
            {"id": 2, "machine_id": 20, "dph_total": 0.40, "gpu_name": "RTX_4090", "num_gpus": 1, "geolocation": "US"},
            {"id": 1, "machine_id": 10, "dph_total": 0.25, "gpu_name": "RTX_4090", "num_gpus": 1},
            {"id": 3, "machine_id": 30},
            {"machine_id": 40, "dph_total": 0.1},
        ]});
        let offers = parse_offers(&body).unwrap();
        assert_eq!(offers.iter().map(|o| o.id).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(offers[0].machine_id, 10);
        assert!(parse_offers(&json!({"error": "x"})).is_err());
        assert_eq!(parse_offers(&json!({"offers": []})).unwrap(), vec![]);
    }

    #[test]
    fn a_create_answer_gives_the_new_instance_or_says_what_is_wrong() {
        assert_eq!(
            parse_created(&json!({"success": true, "new_contract": 12345678})),
            Ok(12345678)
        );
        assert!(
            parse_created(&json!({"success": false, "msg": "nope"}))
                .unwrap_err()
                .contains("nope")
        );
        assert!(parse_created(&json!({"success": true})).is_err());
    }

    #[test]
    fn create_errors_are_classified_as_the_service_words_them() {
        let gone404 = r#"{"success":false,"error":"invalid_args","msg":"error 404/3603: no_such_ask Instance type by id 7 is not available.","ask_id":7}"#;
        assert!(
            matches!(classify_create(404, gone404), CreateFailure::Capacity(m) if m.contains("3603") && m.contains("HTTP 404"))
        );
        let gone410 = r#"{"success":false,"error":"no_such_ask","msg":"Instance type by id 7 is no longer available."}"#;
        assert!(matches!(
            classify_create(410, gone410),
            CreateFailure::Capacity(_)
        ));
        let rented = r#"{"success":false,"error":"invalid_args","msg":"Offer already rented"}"#;
        assert!(matches!(
            classify_create(400, rented),
            CreateFailure::Capacity(_)
        ));
        let image = r#"{"success":false,"error":"invalid_args","msg":"invalid image name"}"#;
        assert!(
            matches!(classify_create(400, image), CreateFailure::Refused(m) if m.contains("invalid image"))
        );
        assert!(matches!(
            classify_create(401, "{\"detail\":\"bad key\"}"),
            CreateFailure::Auth(_)
        ));
        assert!(matches!(classify_create(403, ""), CreateFailure::Auth(_)));
        assert!(matches!(
            classify_create(429, "API requests too frequent, slow down"),
            CreateFailure::RateLimited(m) if m.contains("too frequent")
        ));
        assert!(matches!(
            classify_create(502, "<html>bad gateway</html>"),
            CreateFailure::Unknown(_)
        ));
        assert!(matches!(
            classify_create(500, ""),
            CreateFailure::Unknown(_)
        ));
    }

    #[test]
    fn destroy_counts_an_absent_instance_as_done() {
        assert!(destroy_absent(
            404,
            r#"{"success":false,"error":"not_found","msg":"Instance not found"}"#
        ));
        assert!(destroy_absent(
            200,
            r#"{"success":false,"error":"no_such_instance"}"#
        ));
        assert!(!destroy_absent(500, "not_found"));
        assert!(!destroy_absent(200, r#"{"success":true}"#));
    }

    fn instance(v: Value) -> Instance {
        parse_instance(&v).unwrap()
    }

    #[test]
    fn the_ssh_endpoint_is_the_direct_port_else_the_proxy() {
        let direct = json!({"id": 1, "public_ipaddr": "203.0.113.5", "ports": {"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": "20000"}]}, "ssh_host": "ssh4.vast.ai", "ssh_port": 31000});
        assert_eq!(ssh_endpoint(&direct), Some(("203.0.113.5".into(), 20000)));
        let proxy = json!({"id": 1, "public_ipaddr": "203.0.113.5", "ports": null, "ssh_host": "ssh4.vast.ai", "ssh_port": 31000});
        assert_eq!(ssh_endpoint(&proxy), Some(("ssh4.vast.ai".into(), 31000)));
        let numeric =
            json!({"public_ipaddr": "127.0.0.1", "ports": {"22/tcp": [{"HostPort": 2222}]}});
        assert_eq!(ssh_endpoint(&numeric), Some(("127.0.0.1".into(), 2222)));
        assert_eq!(ssh_endpoint(&json!({"ports": {}, "ssh_port": "x"})), None);
        assert_eq!(ssh_endpoint(&json!({"ssh_host": "h", "ssh_port": 0})), None);
    }

    #[test]
    fn the_ssh_endpoint_follows_the_runtype_the_instance_was_created_with() {
        let both = |runtype: Value| {
            json!({"id": 1, "image_runtype": runtype, "public_ipaddr": "203.0.113.5",
                   "ports": {"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": "20000"}]},
                   "ssh_host": "ssh4.vast.ai", "ssh_port": 31000})
        };
        let direct = Some(("203.0.113.5".to_owned(), 20000));
        let proxy = Some(("ssh4.vast.ai".to_owned(), 31000));
        assert_eq!(instance(both(json!("ssh_direc ssh_proxy"))).ssh, direct);
        assert_eq!(instance(both(json!("ssh_direct"))).ssh, direct);
        assert_eq!(instance(both(json!("ssh_proxy"))).ssh, proxy);
        assert_eq!(instance(both(json!("jupyter_proxy ssh_proxy"))).ssh, proxy);
        // A runtype that says neither: direct, else the proxy.
        assert_eq!(instance(both(Value::Null)).ssh, direct);
        assert_eq!(instance(both(json!("args"))).ssh, direct);
        // A machine without open ports: `ports` has no 22.
        let proxy_only = json!({"id": 2, "actual_status": "running", "public_ipaddr": "203.0.113.5",
                                "ports": {}, "ssh_host": "ssh4.vast.ai", "ssh_port": 31001});
        assert_eq!(ssh_endpoint_for(&proxy_only, SshMode::Direct), None);
        assert_eq!(
            ssh_endpoint_for(&proxy_only, SshMode::Proxy),
            Some(("ssh4.vast.ai".to_owned(), 31001))
        );
        // Direct was asked for: the proxy is not taken instead.
        let mut asked_direct = proxy_only.clone();
        asked_direct["image_runtype"] = json!(SshMode::Direct.runtype());
        assert_eq!(instance(asked_direct.clone()).ssh, None);
        assert!(matches!(
            health(&instance(asked_direct)),
            Health::Pending(_)
        ));
        let mut asked_proxy = proxy_only;
        asked_proxy["image_runtype"] = json!(SshMode::Proxy.runtype());
        assert_eq!(
            health(&instance(asked_proxy)),
            Health::Running("ssh4.vast.ai".into(), 31001)
        );
    }

    #[test]
    fn the_ssh_param_is_direct_by_default_and_proxy_drops_the_open_port_filter() {
        let of = |extra: &[(&str, ParamValue)]| {
            let mut params = vec![("max_dph", ParamValue::Float(0.5))];
            params.extend(extra.iter().cloned());
            GroupParams::of(&template(&params, Some("img")))
        };
        let default = of(&[]).unwrap();
        assert_eq!(default.ssh, SshMode::Direct);
        assert_eq!(
            default.offer_query()["direct_port_count"],
            json!({"gte": 1})
        );
        assert!(default.describe().contains("with open ports"));
        let direct = of(&[("ssh", ParamValue::Str("direct".into()))]).unwrap();
        assert_eq!(direct, default);
        let proxy = of(&[("ssh", ParamValue::Str("proxy".into()))]).unwrap();
        assert_eq!(proxy.ssh, SshMode::Proxy);
        let q = proxy.offer_query();
        assert!(q.get("direct_port_count").is_none(), "{q}");
        // Everything else is asked as before.
        let mut without = default.offer_query();
        without.as_object_mut().unwrap().remove("direct_port_count");
        assert_eq!(q, without);
        assert!(proxy.describe().contains("through the SSH proxy"));
        assert!(!proxy.describe().contains("open ports"));
        assert_eq!(SshMode::Direct.runtype(), "ssh_direc ssh_proxy");
        assert_eq!(SshMode::Proxy.runtype(), "ssh_proxy");
        for bad in [
            ParamValue::Str("ssh_proxy".into()),
            ParamValue::Str("Direct".into()),
            ParamValue::Bool(true),
        ] {
            let e = of(&[("ssh", bad.clone())]).unwrap_err();
            assert!(
                e.starts_with("`ssh` is \"direct\" (the default") && e.contains("\"proxy\""),
                "{bad}: {e}"
            );
        }
        assert!(KNOWN_PARAMS.contains(&"ssh"));
        let unknown = of(&[("sssh", ParamValue::Str("proxy".into()))]).unwrap_err();
        assert!(unknown.contains("bid_dph, ssh)"), "{unknown}");
    }

    #[test]
    fn statuses_map_to_pending_running_failed_or_destroyed() {
        let running = instance(
            json!({"id": 5, "actual_status": "running", "public_ipaddr": "127.0.0.1", "ports": {"22/tcp": [{"HostPort": "2201"}]}}),
        );
        assert_eq!(health(&running), Health::Running("127.0.0.1".into(), 2201));
        let no_port = instance(json!({"id": 5, "actual_status": "running", "ports": null}));
        assert!(matches!(health(&no_port), Health::Pending(_)));
        assert!(matches!(
            health(&instance(json!({"id": 5, "actual_status": null}))),
            Health::Pending(_)
        ));
        assert!(matches!(
            health(&instance(json!({"id": 5}))),
            Health::Pending(_)
        ));
        assert!(matches!(
            health(&instance(json!({"id": 5, "actual_status": "loading"}))),
            Health::Pending(_)
        ));
        assert!(matches!(
            health(&instance(json!({"id": 5, "actual_status": "created"}))),
            Health::Pending(_)
        ));
        let oci = instance(
            json!({"id": 5, "machine_id": 9, "actual_status": "created", "status_msg": "Error response from daemon: OCI runtime create failed: runc create failed"}),
        );
        assert!(
            matches!(health(&oci), Health::Failed(m) if m.contains("failed boot") && m.contains("machine 9") && m.contains("OCI"))
        );
        // Frozen holds (and bills) the GPU and runs nothing; an outbid
        // interruptible instance is stopped though meant to run.
        for dead in ["exited", "offline", "unknown", "frozen", "stopped"] {
            let i = instance(json!({"id": 5, "actual_status": dead}));
            assert!(
                matches!(health(&i), Health::Failed(m) if m.contains(dead)),
                "{dead}"
            );
        }
        assert_eq!(
            health(&instance(json!({"id": 5, "actual_status": "rebooting"}))),
            Health::Pending("rebooting".into())
        );
        let stopped =
            instance(json!({"id": 5, "actual_status": "running", "intended_status": "stopped"}));
        assert!(matches!(health(&stopped), Health::Failed(_)));
        assert_eq!(
            health(&instance(json!({"id": 5, "actual_status": "destroyed"}))),
            Health::Destroyed
        );
    }

    #[test]
    fn listings_and_shows_are_read_from_v0_and_v1_shapes() {
        let v1 = json!({"instances": [{"id": 1, "label": "swactor:r:g-0:1", "dph_total": 0.3}, {"no": "id"}], "next_token": "abc", "total_instances": 30});
        let (list, next) = parse_instance_page(&v1).unwrap();
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].label.as_deref(), Some("swactor:r:g-0:1"));
        assert_eq!(list[0].dph_total, Some(0.3));
        assert_eq!(next.as_deref(), Some("abc"));
        let last = json!({"instances": [], "next_token": null});
        assert_eq!(parse_instance_page(&last).unwrap(), (vec![], None));
        assert_eq!(
            parse_instance_page(&json!({"instances": null})).unwrap(),
            (vec![], None)
        );
        assert!(parse_instance_page(&json!({"detail": "x"})).is_err());

        assert_eq!(parse_shown(&json!({"instances": null})), Ok(None));
        assert_eq!(
            parse_shown(&json!({"instances": {"id": 4}}))
                .unwrap()
                .unwrap()
                .id,
            4
        );
        assert!(parse_shown(&json!({"oops": 1})).is_err());
        assert!(parse_shown(&json!({"instances": {"no": "id"}})).is_err());
    }

    #[test]
    fn the_spend_cap_counts_every_live_instance_and_the_offer() {
        assert!((check_spend(1.0, &[0.3, 0.3], 0.4).unwrap() - 1.0).abs() < 1e-9);
        let refusal = check_spend(1.0, &[0.3, 0.3, 0.3], 0.4).unwrap_err();
        assert!(refusal.contains("1.000 $/h"), "{refusal}");
        assert!(
            refusal.contains("3 live instance(s) cost 0.900 $/h"),
            "{refusal}"
        );
        assert!(refusal.contains("0.400 $/h"), "{refusal}");
        assert!(refusal.contains("1.300 $/h in all"), "{refusal}");
        assert!(check_spend(0.2, &[], 0.4).is_err());
        assert!(check_spend(0.4, &[], 0.4).is_ok());
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_never_overflows() {
        let b = |n| backoff(n, Duration::from_millis(500), Duration::from_secs(30));
        assert_eq!(b(0), Duration::from_millis(500));
        assert_eq!(b(1), Duration::from_millis(500));
        assert_eq!(b(2), Duration::from_secs(1));
        assert_eq!(b(3), Duration::from_secs(2));
        assert_eq!(b(7), Duration::from_secs(30));
        assert_eq!(b(u32::MAX), Duration::from_secs(30));
    }

    #[test]
    fn the_secret_is_redacted_everywhere_it_appears() {
        let key = "0123456789abcdef";
        let text = format!("GET https://h/api?api_key={key} failed; key {key}");
        let out = redact(&text, key);
        assert!(!out.contains(key));
        assert_eq!(out.matches("[redacted]").count(), 2);
        assert_eq!(redact("x", ""), "x");
    }

    #[test]
    fn error_messages_come_from_msg_detail_or_the_text_cut_short() {
        assert_eq!(
            message_of_text(r#"{"detail":"API requests too frequent"}"#),
            "API requests too frequent"
        );
        assert_eq!(message_of_text("plain words"), "plain words");
        let long = "x".repeat(1000);
        assert!(message_of_text(&long).chars().count() <= MESSAGE_LEN_MAX + 1);
    }
}
