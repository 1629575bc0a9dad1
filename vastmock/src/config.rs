//! The mock's configuration: timings, rate limits and the offer catalogue.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

/// An offer's storage price unless its `extra` names one: dollars per GB
/// and month.
pub(crate) const STORAGE_COST_DEFAULT: f64 = 0.15;

/// How the mock behaves; a plain struct, checked by [`MockConfig::validate`].
///
/// [`MockConfig::default`] is realistic (rate limits as Vast.ai documents
/// them, a few seconds of boot); [`MockConfig::fast`] is for tests that do
/// not test timing: no rate limits and a boot of a few hundred milliseconds.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// Address to listen on; port 0 picks a free one.
    pub listen: std::net::SocketAddr,
    /// The account's API key; `None` makes one up (see [`crate::VastMock::api_key`]).
    pub api_key: Option<String>,
    /// Where instance machine directories live; `None`: a temporary
    /// directory removed when the mock is dropped. A given directory is kept,
    /// but each instance's directory is removed when it is destroyed.
    pub state_dir: Option<PathBuf>,
    /// Boot timings of new instances.
    pub timings: Timings,
    /// Minimum intervals between two calls of one endpoint with one key.
    pub rate_limits: RateLimits,
    /// The offers `POST /bundles/` searches and `PUT /asks/{id}/` rents.
    pub offers: Vec<Offer>,
    /// Whether a running instance gets a real `sshd`. Without it, `ports`
    /// still names a loopback port, on which nothing listens.
    pub real_ssh: bool,
    /// The account's SSH public keys at start (`authorized_keys` lines).
    pub ssh_keys: Vec<String>,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            api_key: None,
            state_dir: None,
            timings: Timings::default(),
            rate_limits: RateLimits::default(),
            offers: default_offers(),
            real_ssh: true,
            ssh_keys: Vec::new(),
        }
    }
}

impl MockConfig {
    /// The default configuration with rate limits off and boots of about
    /// 300 ms (100 ms provisioning, 200 ms loading).
    pub fn fast() -> Self {
        Self {
            timings: Timings {
                provisioning: Duration::from_millis(100),
                loading: Duration::from_millis(200),
                restart: Duration::from_millis(100),
                destroyed_visible: Duration::ZERO,
            },
            rate_limits: RateLimits {
                scale: 0.0,
                ..RateLimits::default()
            },
            ..Self::default()
        }
    }

    /// Checks the configuration for values the mock cannot honour.
    ///
    /// # Errors
    /// A message naming the first bad field.
    pub fn validate(&self) -> Result<(), crate::InvalidArgument> {
        self.check().map_err(crate::InvalidArgument)
    }

    fn check(&self) -> Result<(), String> {
        if !self.listen.ip().is_loopback() {
            return Err(format!(
                "listen address {} is not loopback: the mock serves tests on this machine only",
                self.listen
            ));
        }
        if !(self.rate_limits.scale.is_finite() && self.rate_limits.scale >= 0.0) {
            return Err(format!(
                "rate_limits.scale must be finite and >= 0, got {}",
                self.rate_limits.scale
            ));
        }
        let mut ids = std::collections::HashSet::new();
        for offer in &self.offers {
            if !ids.insert(offer.id) {
                return Err(format!("offer id {} appears twice", offer.id));
            }
        }
        if let Some(key) = &self.api_key
            && (key.is_empty() || key.chars().any(char::is_whitespace))
        {
            return Err("api_key must be non-empty and hold no whitespace".to_owned());
        }
        Ok(())
    }
}

/// Boot timings of an instance, measured from its creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timings {
    /// How long `actual_status` stays null (scheduling, before the image pull).
    pub provisioning: Duration,
    /// How long it then stays `loading` before `running`.
    pub loading: Duration,
    /// How long a started (previously stopped) instance stays `loading`, and
    /// a rebooted one `rebooting`.
    pub restart: Duration,
    /// How long a destroyed instance is still listed as `destroyed` before it
    /// vanishes; zero: it vanishes at once.
    pub destroyed_visible: Duration,
}

impl Default for Timings {
    fn default() -> Self {
        Self {
            provisioning: Duration::from_millis(1000),
            loading: Duration::from_millis(3000),
            restart: Duration::from_millis(1000),
            destroyed_visible: Duration::ZERO,
        }
    }
}

/// A rate-limited endpoint group (one minimum interval each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `POST /bundles/`.
    Search,
    /// `PUT /asks/{id}/` and `POST /asks/bulk/`.
    Create,
    /// `DELETE /instances/{id}/` and `DELETE /instances/`.
    Destroy,
    /// `GET /instances/{id}/`.
    Show,
    /// `GET /instances/` (v0) and `GET /api/v1/instances/`.
    List,
    /// `PUT /instances/{id}/` (label changes, stop/start), `PUT /instances/`
    /// (bulk stop/start), `PUT /instances/reboot/{id}/` and
    /// `PUT /instances/bid_price/{id}/`.
    Label,
}

impl Endpoint {
    /// Every endpoint, in a fixed order.
    pub const ALL: [Endpoint; 6] = [
        Endpoint::Search,
        Endpoint::Create,
        Endpoint::Destroy,
        Endpoint::Show,
        Endpoint::List,
        Endpoint::Label,
    ];

    /// Its name in the admin API (`"create"`, …).
    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Search => "search",
            Endpoint::Create => "create",
            Endpoint::Destroy => "destroy",
            Endpoint::Show => "show",
            Endpoint::List => "list",
            Endpoint::Label => "label",
        }
    }
}

/// Minimum intervals between two accepted calls of one endpoint with one
/// key; the effective interval is the value times `scale`.
///
/// The listing also allows a short burst (`list_burst` calls at once, then
/// one per `list` interval, as a token bucket): the official client pages
/// `GET /api/v1/instances/` back to back (25 rows a page) and gives up after
/// three tries within about 0.4 s, and the real service serves its paging.
/// Every other endpoint allows one call per interval.
/// [`crate::VastMock::strict_rate_limits`] takes the burst away.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RateLimits {
    /// `POST /bundles/` (Vast.ai allows about 10 a minute).
    pub search: Duration,
    /// `PUT /asks/{id}/` and `POST /asks/bulk/`.
    pub create: Duration,
    /// `DELETE /instances/{id}/` and `DELETE /instances/`.
    pub destroy: Duration,
    /// `GET /instances/{id}/`.
    pub show: Duration,
    /// Listings (v0 and v1).
    pub list: Duration,
    /// `PUT /instances/{id}/` and the other `PUT /instances/...` calls.
    pub label: Duration,
    /// Listing calls accepted at once (at least 1) before the `list`
    /// interval applies: enough to page through 250 instances.
    #[serde(default = "default_list_burst")]
    pub list_burst: u32,
    /// Factor on every interval: 1.0 is realistic, 0.0 turns limits off,
    /// 0.01 keeps them but a hundred times shorter.
    pub scale: f64,
}

impl Default for RateLimits {
    fn default() -> Self {
        Self {
            search: Duration::from_millis(6000),
            create: Duration::from_millis(4500),
            destroy: Duration::from_millis(3000),
            show: Duration::from_millis(2000),
            list: Duration::from_millis(1000),
            label: Duration::from_millis(1000),
            list_burst: default_list_burst(),
            scale: 1.0,
        }
    }
}

fn default_list_burst() -> u32 {
    10
}

impl RateLimits {
    /// The effective minimum interval of `endpoint` (scaled).
    pub fn interval(&self, endpoint: Endpoint) -> Duration {
        let base = match endpoint {
            Endpoint::Search => self.search,
            Endpoint::Create => self.create,
            Endpoint::Destroy => self.destroy,
            Endpoint::Show => self.show,
            Endpoint::List => self.list,
            Endpoint::Label => self.label,
        };
        base.mul_f64(self.scale)
    }

    /// How many calls of `endpoint` may come at once (at least 1).
    pub fn burst(&self, endpoint: Endpoint) -> u32 {
        match endpoint {
            Endpoint::List => self.list_burst.max(1),
            _ => 1,
        }
    }
}

/// One rentable offer (a machine's GPUs at a price), as `POST /bundles/` lists it.
///
/// The fields here are the ones the mock reasons about; `extra` holds any
/// other field to list verbatim (and to filter on).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Offer {
    /// The offer (ask) id, what `PUT /asks/{id}/` takes.
    pub id: u64,
    /// The machine it is on.
    pub machine_id: u64,
    /// The host owning the machine.
    pub host_id: u64,
    /// GPU model, e.g. `"RTX 4090"` (filters treat `_` as a space).
    pub gpu_name: String,
    /// GPUs in the offer.
    pub num_gpus: u32,
    /// Memory per GPU in MB.
    pub gpu_ram: u64,
    /// On-demand price in $/hour, storage included.
    pub dph_total: f64,
    /// The lowest bid for an interruptible rental, $/hour.
    pub min_bid: f64,
    /// Reliability score in [0, 1].
    pub reliability2: f64,
    /// Where the machine is, e.g. `"Sweden, SE"`.
    pub geolocation: String,
    /// Disk available to an instance, GB.
    pub disk_space: f64,
    /// Whether the machine is verified.
    pub verified: bool,
    /// The search ranking (higher first by default).
    pub score: f64,
    /// More fields, listed as they are.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Default for Offer {
    fn default() -> Self {
        Self {
            id: 0,
            machine_id: 0,
            host_id: 0,
            gpu_name: "RTX 4090".to_owned(),
            num_gpus: 1,
            gpu_ram: 24564,
            dph_total: 0.4,
            min_bid: 0.2,
            reliability2: 0.99,
            geolocation: "Sweden, SE".to_owned(),
            disk_space: 100.0,
            verified: true,
            score: 100.0,
            extra: serde_json::Map::new(),
        }
    }
}

impl Offer {
    /// Its JSON row as the search lists it, given whether it is rented now.
    pub fn to_json(&self, rented: bool) -> serde_json::Value {
        let mut row = serde_json::json!({
            "id": self.id,
            "ask_contract_id": self.id,
            "bundle_id": self.id,
            "machine_id": self.machine_id,
            "host_id": self.host_id,
            "gpu_name": self.gpu_name,
            "num_gpus": self.num_gpus,
            "gpu_ram": self.gpu_ram,
            "gpu_total_ram": self.gpu_ram * u64::from(self.num_gpus),
            "gpu_frac": 1.0,
            "dph_total": self.dph_total,
            "dph_base": self.dph_total * 0.9,
            "min_bid": self.min_bid,
            "reliability": self.reliability2,
            "reliability2": self.reliability2,
            "geolocation": self.geolocation,
            "disk_space": self.disk_space,
            "disk_bw": 2000.0,
            "verified": self.verified,
            "verification": if self.verified { "verified" } else { "unverified" },
            "score": self.score,
            "rentable": !rented,
            "rented": rented,
            "external": false,
            "public_ipaddr": "127.0.0.1",
            "direct_port_count": 64,
            "static_ip": true,
            "cpu_cores": 32,
            "cpu_cores_effective": 8.0 * f64::from(self.num_gpus),
            "cpu_ram": 64000,
            "cpu_ghz": 3.5,
            "cpu_arch": "amd64",
            "cuda_max_good": 12.4,
            "driver_version": "550.54.14",
            "inet_up": 800.0,
            "inet_down": 900.0,
            "pcie_bw": 24.0,
            "dlperf": 80.0 * f64::from(self.num_gpus),
            "dlperf_per_dphtotal": 80.0 * f64::from(self.num_gpus) / self.dph_total.max(0.001),
            "total_flops": 80.0 * f64::from(self.num_gpus),
            "duration": 30.0 * 24.0 * 3600.0,
            "storage_cost": STORAGE_COST_DEFAULT,
            "vms_enabled": false,
            "hosting_type": 0,
        });
        if let Some(map) = row.as_object_mut() {
            for (k, v) in &self.extra {
                map.insert(k.clone(), v.clone());
            }
        }
        row
    }
}

/// Nine offers with different GPUs, sizes, prices, reliabilities and places
/// (two of them fit `examples/vast.toml`, which rents two machines).
pub fn default_offers() -> Vec<Offer> {
    let rows: [(&str, u32, u64, f64, f64, &str, f64); 9] = [
        ("RTX 4090", 1, 24564, 0.35, 0.995, "Sweden, SE", 200.0),
        (
            "RTX 4090",
            2,
            24564,
            0.72,
            0.980,
            "United States, US",
            400.0,
        ),
        ("RTX 3090", 1, 24576, 0.18, 0.970, "Germany, DE", 120.0),
        ("RTX A6000", 1, 49140, 0.55, 0.990, "Canada, CA", 300.0),
        (
            "A100 SXM4",
            1,
            81920,
            1.20,
            0.999,
            "United States, US",
            500.0,
        ),
        ("H100 SXM", 8, 81559, 22.00, 0.998, "Finland, FI", 2000.0),
        ("RTX 3060", 1, 12288, 0.06, 0.900, "Poland, PL", 50.0),
        ("RTX 4090", 1, 24564, 0.29, 0.850, "Vietnam, VN", 80.0),
        (
            "RTX 4090",
            1,
            24564,
            0.42,
            0.985,
            "United States, US",
            250.0,
        ),
    ];
    rows.iter()
        .enumerate()
        .map(|(i, &(gpu, n, ram, dph, rel, geo, disk))| {
            let i = i as u64;
            Offer {
                id: 3_100_001 + i,
                machine_id: 41_000 + i * 7,
                host_id: 900 + i / 2,
                gpu_name: gpu.to_owned(),
                num_gpus: n,
                gpu_ram: ram,
                dph_total: dph,
                min_bid: (dph * 0.5 * 1000.0).round() / 1000.0,
                reliability2: rel,
                geolocation: geo.to_owned(),
                disk_space: disk,
                verified: i != 6,
                score: 100.0 * rel * f64::from(n) / dph.max(0.05).sqrt(),
                extra: serde_json::Map::new(),
            }
        })
        .collect()
}
