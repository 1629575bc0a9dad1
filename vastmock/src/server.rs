//! The HTTP side: routes of the Vast.ai API and the admin API, over our own accept loop.
//!
//! Handlers decode a request into a [`Call`], run it on the [`World`] on
//! the blocking pool (a call may start an sshd), and deliver the [`Reply`]:
//! written, or held and then cut, or cut at once (the accept loop owns each
//! connection and drops it when a handler asks).

use crate::config::{Endpoint, Offer};
use crate::faults::{Ambiguity, Death, Gone, InstanceFault, Selector};
use crate::world::{After, Body, Call, Reply, World};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// The state the server and the Rust API share.
#[derive(Debug)]
pub(crate) struct Shared {
    world: Mutex<World>,
}

impl Shared {
    pub(crate) fn new(world: World) -> Self {
        Self {
            world: Mutex::new(world),
        }
    }

    /// The world, even after a panic elsewhere poisoned the lock: the mock
    /// must keep answering (and cleaning up) for the tests that use it.
    pub(crate) fn world(&self) -> MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Tells the accept loop to drop this request's connection.
#[derive(Debug, Clone)]
struct Cut(Arc<Notify>);

/// What every API handler needs from the request head.
struct Ctx {
    shared: Arc<Shared>,
    cut: Option<Cut>,
    key: Option<String>,
    query: HashMap<String, String>,
}

impl FromRequestParts<Arc<Shared>> for Ctx {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<Shared>,
    ) -> Result<Self, Self::Rejection> {
        let query = Query::<HashMap<String, String>>::try_from_uri(&parts.uri)
            .map(|q| q.0)
            .unwrap_or_default();
        let bearer = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|k| k.trim().to_owned());
        let key = bearer.or_else(|| query.get("api_key").cloned());
        Ok(Self {
            shared: state.clone(),
            cut: parts.extensions.get::<Cut>().cloned(),
            key,
            query,
        })
    }
}

fn body_json(bytes: &Bytes) -> Result<Value, Reply> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    serde_json::from_slice(bytes)
        .map_err(|e| Reply::invalid_args(format!("invalid JSON body: {e}")))
}

/// Runs `call` on the world and delivers the reply.
async fn api(ctx: Ctx, call: Result<Call, Reply>) -> Response {
    let shared = ctx.shared.clone();
    let key = ctx.key.clone();
    let reply = tokio::task::spawn_blocking(move || match call {
        Ok(call) => shared.world().handle(key.as_deref(), call, Instant::now()),
        Err(reply) => reply,
    })
    .await
    .unwrap_or_else(|_| Reply::json(500, json!({"success": false, "error": "mock_panic"})));
    deliver(reply, ctx.cut).await
}

async fn deliver(reply: Reply, cut: Option<Cut>) -> Response {
    let hold = match reply.after {
        After::Respond => return into_response(reply),
        After::HoldThenCut(hold) => hold,
        After::Cut => Duration::ZERO,
    };
    tokio::time::sleep(hold).await;
    match cut {
        Some(cut) => {
            cut.0.notify_one();
            std::future::pending().await
        }
        None => into_response(Reply::json(
            502,
            json!({"error": "connection could not be cut"}),
        )),
    }
}

fn into_response(reply: Reply) -> Response {
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    match reply.body {
        Body::Json(v) => (status, axum::Json(v)).into_response(),
        Body::Text(text, content_type) => {
            let mut resp = (status, text).into_response();
            resp.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            resp
        }
    }
}

/// Registers `path` with and without its trailing slash.
fn both(
    router: Router<Arc<Shared>>,
    path: &str,
    mr: MethodRouter<Arc<Shared>>,
) -> Router<Arc<Shared>> {
    router
        .route(path, mr.clone())
        .route(&format!("{path}/"), mr)
}

/// The API under `/api/v0` (and `/api/v1/instances`) plus `/admin`.
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let mut r: Router<Arc<Shared>> = Router::new();
    r = offer_routes(r);
    r = instance_action_routes(r);
    r = results_route(r);
    r = instance_routes(r);
    r = account_routes(r);
    r = admin_routes(r);
    r.fallback(|| async {
        (
            StatusCode::NOT_FOUND,
            axum::Json(
                json!({"success": false, "error": "not_found", "msg": "No such API route."}),
            ),
        )
    })
    .with_state(shared)
}

/// Routes that search offers and rent them.
fn offer_routes(mut r: Router<Arc<Shared>>) -> Router<Arc<Shared>> {
    r = both(
        r,
        "/api/v0/bundles",
        post(|ctx: Ctx, b: Bytes| async move {
            let call = body_json(&b).map(|body| Call::Search { body });
            api(ctx, call).await
        }),
    );
    r = both(
        r,
        "/api/v0/asks/{id}",
        axum::routing::put(|ctx: Ctx, Path(offer_id): Path<u64>, b: Bytes| async move {
            let call = body_json(&b).map(|body| Call::Create { offer_id, body });
            api(ctx, call).await
        }),
    );
    r = both(
        r,
        "/api/v0/asks/bulk",
        post(|ctx: Ctx, b: Bytes| async move {
            let call = body_json(&b).map(|body| Call::CreateBulk { body });
            api(ctx, call).await
        }),
    );
    r
}

/// Routes that change instances in bulk, or reboot, rebid, log or command one.
fn instance_action_routes(mut r: Router<Arc<Shared>>) -> Router<Arc<Shared>> {
    r = both(
        r,
        "/api/v0/instances",
        get(|ctx: Ctx| async move { api(ctx, Ok(Call::ListV0)).await })
            .put(|ctx: Ctx, b: Bytes| async move {
                let call = body_json(&b).map(|body| Call::UpdateBulk { body });
                api(ctx, call).await
            })
            .delete(|ctx: Ctx, b: Bytes| async move {
                let call = body_json(&b).map(|body| Call::DestroyBulk { body });
                api(ctx, call).await
            }),
    );
    r = both(
        r,
        "/api/v0/instances/reboot/{id}",
        axum::routing::put(|ctx: Ctx, Path(id): Path<u64>| async move {
            api(ctx, Ok(Call::Reboot { id })).await
        }),
    );
    r = both(
        r,
        "/api/v0/instances/bid_price/{id}",
        axum::routing::put(|ctx: Ctx, Path(id): Path<u64>, b: Bytes| async move {
            let call = body_json(&b).map(|body| Call::ChangeBid { id, body });
            api(ctx, call).await
        }),
    );
    r = both(
        r,
        "/api/v0/instances/request_logs/{id}",
        axum::routing::put(|ctx: Ctx, Path(id): Path<u64>, b: Bytes| async move {
            let call = body_json(&b).map(|body| Call::Logs { id, body });
            api(ctx, call).await
        }),
    );
    r = both(
        r,
        "/api/v0/instances/command/{id}",
        axum::routing::put(|ctx: Ctx, Path(id): Path<u64>, b: Bytes| async move {
            let call = body_json(&b).map(|body| Call::Execute { id, body });
            api(ctx, call).await
        }),
    );
    r
}

/// Where `result_url`s point (logs, command outputs): no key, like the real storage links.
fn results_route(mut r: Router<Arc<Shared>>) -> Router<Arc<Shared>> {
    r = r.route(
        "/results/{token}",
        get(|State(s): State<Arc<Shared>>, Path(token): Path<String>| async move {
            match s.world().result(&token) {
                Some(text) => (
                    StatusCode::OK,
                    [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                    text,
                )
                    .into_response(),
                None => (
                    StatusCode::NOT_FOUND,
                    [(header::CONTENT_TYPE, "application/xml")],
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>NoSuchKey</Code></Error>".to_owned(),
                )
                    .into_response(),
            }
        }),
    );
    r
}

/// Routes that list instances, and show, change, destroy or attach a key to one.
fn instance_routes(mut r: Router<Arc<Shared>>) -> Router<Arc<Shared>> {
    r = both(
        r,
        "/api/v1/instances",
        get(|ctx: Ctx| async move {
            let query = ctx.query.clone();
            api(ctx, Ok(Call::ListV1 { query })).await
        }),
    );
    r = both(
        r,
        "/api/v0/instances/filters",
        get(|ctx: Ctx| async move { api(ctx, Ok(Call::Filters)).await }),
    );
    r = both(
        r,
        "/api/v0/instances/{id}",
        get(|ctx: Ctx, Path(id): Path<u64>| async move { api(ctx, Ok(Call::Show { id })).await })
            .put(|ctx: Ctx, Path(id): Path<u64>, b: Bytes| async move {
                let call = body_json(&b).map(|body| Call::Update { id, body });
                api(ctx, call).await
            })
            .delete(|ctx: Ctx, Path(id): Path<u64>| async move {
                api(ctx, Ok(Call::Destroy { id })).await
            }),
    );
    r = both(
        r,
        "/api/v0/instances/{id}/ssh",
        post(|ctx: Ctx, Path(id): Path<u64>, b: Bytes| async move {
            let call = body_json(&b).map(|body| Call::SshAttach { id, body });
            api(ctx, call).await
        }),
    );
    r
}

/// Routes of the account: its SSH keys and its user.
fn account_routes(mut r: Router<Arc<Shared>>) -> Router<Arc<Shared>> {
    r = both(
        r,
        "/api/v0/ssh",
        get(|ctx: Ctx| async move { api(ctx, Ok(Call::SshList)).await }).post(
            |ctx: Ctx, b: Bytes| async move {
                let call = body_json(&b).map(|body| Call::SshCreate { body });
                api(ctx, call).await
            },
        ),
    );
    r = both(
        r,
        "/api/v0/ssh/{id}",
        axum::routing::delete(|ctx: Ctx, Path(id): Path<u64>| async move {
            api(ctx, Ok(Call::SshDelete { id })).await
        }),
    );
    r = both(
        r,
        "/api/v0/users/current",
        get(|ctx: Ctx| async move { api(ctx, Ok(Call::CurrentUser)).await }),
    );
    r
}

// ---- admin ------------------------------------------------------------------

/// Runs `f` on the world on the blocking pool and answers its JSON or a 400.
async fn admin<F>(shared: Arc<Shared>, f: F) -> Response
where
    F: FnOnce(&mut World, Instant) -> Result<Value, String> + Send + 'static,
{
    let result = tokio::task::spawn_blocking(move || f(&mut shared.world(), Instant::now()))
        .await
        .unwrap_or_else(|_| Err("the mock panicked".to_owned()));
    match result {
        Ok(v) => (StatusCode::OK, axum::Json(v)).into_response(),
        Err(msg) => (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"success": false, "error": "invalid_args", "msg": msg})),
        )
            .into_response(),
    }
}

fn parse<T: for<'de> Deserialize<'de>>(b: &Bytes) -> Result<T, String> {
    serde_json::from_slice(b).map_err(|e| format!("invalid admin body: {e}"))
}

#[derive(Deserialize)]
struct TargetBody {
    target: Selector,
    #[serde(default)]
    loading_ms: Option<u64>,
}

#[derive(Deserialize)]
struct TimingsBody {
    provisioning_ms: u64,
    loading_ms: u64,
    restart_ms: u64,
    #[serde(default)]
    destroyed_visible_ms: u64,
}

#[derive(Deserialize)]
struct OfferGoneBody {
    offer_id: u64,
    /// `None` clears the knob for the offer.
    kind: Option<Gone>,
}

#[derive(Deserialize)]
struct BurstBody {
    endpoint: Endpoint,
    count: u32,
}

/// `{"target": T, "in_ms": N}` (contracts) or `{"offer_id": N, "in_ms": N}` (a listing).
#[derive(Deserialize)]
struct ExpireBody {
    #[serde(default)]
    target: Option<Selector>,
    #[serde(default)]
    offer_id: Option<u64>,
    in_ms: u64,
}

#[derive(Deserialize)]
struct KillBody {
    target: Selector,
    death: Death,
}

#[derive(Deserialize)]
struct AmbiguousBody {
    kind: Ambiguity,
    #[serde(default = "one")]
    count: u32,
}

fn one() -> u32 {
    1
}

#[derive(Deserialize)]
struct FlakyBody {
    count: u32,
    #[serde(default)]
    status: Option<u16>,
}

#[derive(Deserialize)]
struct RandomBody {
    probability: f64,
    #[serde(default)]
    seed: u64,
}

fn ok() -> Result<Value, String> {
    Ok(json!({"success": true}))
}

/// The admin API: read and set up the world, and inject faults.
fn admin_routes(r: Router<Arc<Shared>>) -> Router<Arc<Shared>> {
    let r = admin_setup_routes(r);
    let r = admin_api_fault_routes(r);
    let r = admin_instance_fault_routes(r);
    admin_answer_fault_routes(r)
}

/// Admin routes that read the world, or set up its offers, keys, rates and timings.
fn admin_setup_routes(r: Router<Arc<Shared>>) -> Router<Arc<Shared>> {
    type S = State<Arc<Shared>>;
    r.route(
        "/admin/state",
        get(|State(s): S| admin(s, |w, now| Ok(crate::admin_state(w, now)))),
    )
    .route(
        "/admin/counters",
        get(|State(s): S| admin(s, |w, _| Ok(crate::admin_counters(w)))),
    )
    .route(
        "/admin/offers",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, now| {
                w.add_offer(parse::<Offer>(&b)?, now)?;
                ok()
            })
        }),
    )
    .route(
        "/admin/ssh_keys",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, _| {
                let v: Value = parse(&b)?;
                let key = v
                    .get("ssh_key")
                    .and_then(Value::as_str)
                    .ok_or("ssh_key missing")?;
                Ok(json!({"success": true, "id": w.add_account_key(key)?}))
            })
        }),
    )
    .route(
        "/admin/rate_scale",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, _| {
                let v: Value = parse(&b)?;
                let scale = v
                    .get("scale")
                    .and_then(Value::as_f64)
                    .ok_or("scale missing")?;
                w.set_rate_scale(scale)?;
                ok()
            })
        }),
    )
    .route(
        "/admin/timings",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, _| {
                let t: TimingsBody = parse(&b)?;
                w.set_timings(crate::Timings {
                    provisioning: Duration::from_millis(t.provisioning_ms),
                    loading: Duration::from_millis(t.loading_ms),
                    restart: Duration::from_millis(t.restart_ms),
                    destroyed_visible: Duration::from_millis(t.destroyed_visible_ms),
                });
                ok()
            })
        }),
    )
}

/// Admin routes of faults in how the API treats offers and rate limits.
fn admin_api_fault_routes(r: Router<Arc<Shared>>) -> Router<Arc<Shared>> {
    type S = State<Arc<Shared>>;
    r.route(
        "/admin/faults/offer_gone",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, _| {
                let body: OfferGoneBody = parse(&b)?;
                match body.kind {
                    Some(kind) => w.faults.offers_gone.insert(body.offer_id, kind),
                    None => w.faults.offers_gone.remove(&body.offer_id),
                };
                ok()
            })
        }),
    )
    .route(
        "/admin/faults/rate_burst",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, _| {
                let body: BurstBody = parse(&b)?;
                w.faults.rate_bursts.insert(body.endpoint, body.count);
                ok()
            })
        }),
    )
    .route(
        "/admin/faults/malformed",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, _| {
                let body: BurstBody = parse(&b)?;
                w.faults.malformed.insert(body.endpoint, body.count);
                ok()
            })
        }),
    )
    .route(
        "/admin/faults/rate_limit_text",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, _| {
                let v: Value = parse(&b)?;
                w.faults.text_429 = v
                    .get("text")
                    .and_then(Value::as_bool)
                    .ok_or("text missing")?;
                ok()
            })
        }),
    )
    .route(
        "/admin/faults/strict_rate_limits",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, _| {
                let v: Value = parse(&b)?;
                w.faults.strict_rate_limits = v
                    .get("strict")
                    .and_then(Value::as_bool)
                    .ok_or("strict missing")?;
                ok()
            })
        }),
    )
}

/// Admin routes of faults of instances: slow, stuck or failed boots, deaths, expiries.
fn admin_instance_fault_routes(r: Router<Arc<Shared>>) -> Router<Arc<Shared>> {
    type S = State<Arc<Shared>>;
    r.route(
        "/admin/faults/slow_loading",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, now| {
                let body: TargetBody = parse(&b)?;
                let ms = body.loading_ms.ok_or("loading_ms missing")?;
                w.instance_fault(
                    &body.target,
                    InstanceFault::SlowLoading(Duration::from_millis(ms)),
                    now,
                );
                ok()
            })
        }),
    )
    .route(
        "/admin/faults/stuck_loading",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, now| {
                let body: TargetBody = parse(&b)?;
                w.instance_fault(&body.target, InstanceFault::StuckLoading, now);
                ok()
            })
        }),
    )
    .route(
        "/admin/faults/boot_failure",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, now| {
                let body: TargetBody = parse(&b)?;
                w.instance_fault(&body.target, InstanceFault::BootFailure, now);
                ok()
            })
        }),
    )
    .route(
        "/admin/faults/ssh_never_ready",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, now| {
                let body: TargetBody = parse(&b)?;
                w.instance_fault(&body.target, InstanceFault::SshNeverReady, now);
                ok()
            })
        }),
    )
    .route(
        "/admin/faults/kill",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, now| {
                let body: KillBody = parse(&b)?;
                if matches!(body.target, Selector::Next(_) | Selector::AllNew) {
                    return Err("kill takes an id or a label target".to_owned());
                }
                Ok(json!({"success": true, "killed": w.kill(&body.target, body.death, now)}))
            })
        }),
    )
    .route(
        "/admin/faults/expire",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, now| {
                let body: ExpireBody = parse(&b)?;
                let after = Duration::from_millis(body.in_ms);
                match (body.target, body.offer_id) {
                    (Some(Selector::Next(_) | Selector::AllNew), _) => {
                        Err("expire takes an id or a label target".to_owned())
                    }
                    (Some(target), None) => Ok(json!({
                        "success": true,
                        "expiring": w.expire_instances(&target, after, now),
                    })),
                    (None, Some(offer)) => {
                        w.expire_offer(offer, after, now)?;
                        ok()
                    }
                    _ => Err("give either target or offer_id".to_owned()),
                }
            })
        }),
    )
}

/// Admin routes of faults in answers (creates, listings, destroys, 5xx), and clearing faults.
fn admin_answer_fault_routes(r: Router<Arc<Shared>>) -> Router<Arc<Shared>> {
    type S = State<Arc<Shared>>;
    r.route(
        "/admin/faults/ambiguous_create",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, _| {
                let body: AmbiguousBody = parse(&b)?;
                for _ in 0..body.count {
                    w.faults.ambiguous.push(body.kind);
                }
                ok()
            })
        }),
    )
    .route(
        "/admin/faults/listing_lag",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, _| {
                let v: Value = parse(&b)?;
                let ms = v
                    .get("lag_ms")
                    .and_then(Value::as_u64)
                    .ok_or("lag_ms missing")?;
                w.faults.listing_lag = Duration::from_millis(ms);
                ok()
            })
        }),
    )
    .route(
        "/admin/faults/flaky_destroy",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, _| {
                let body: FlakyBody = parse(&b)?;
                crate::set_flaky_destroy(w, body.count, body.status.unwrap_or(500))?;
                ok()
            })
        }),
    )
    .route(
        "/admin/faults/random_5xx",
        post(|State(s): S, b: Bytes| {
            admin(s, move |w, _| {
                let body: RandomBody = parse(&b)?;
                crate::set_random_5xx(w, body.probability, body.seed)?;
                ok()
            })
        }),
    )
    .route(
        "/admin/faults/clear",
        post(|State(s): S| {
            admin(s, |w, _| {
                crate::clear_faults(w);
                ok()
            })
        }),
    )
}

// ---- the accept loop --------------------------------------------------------

/// Serves `app` on `listener` until `stop` fires; each connection can be cut
/// by its handler (see [`Cut`]).
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => {
                    // Out of descriptors and the like: let it pass.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let app = app.clone();
        tokio::spawn(async move {
            let cut = Cut(Arc::new(Notify::new()));
            let cut_for_requests = cut.clone();
            let service = hyper::service::service_fn(
                move |mut req: hyper::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(cut_for_requests.clone());
                    let app = app.clone();
                    async move { tower::ServiceExt::oneshot(app, req).await }
                },
            );
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = conn => {}
                // Dropping the connection closes the socket, unanswered.
                _ = cut.0.notified() => {}
            }
        });
    }
}
