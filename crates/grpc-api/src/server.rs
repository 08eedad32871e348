//! The `NodeService` server over a [`Dataplane`]: every change gets a node
//! revision and a Watch event; watchers resume from a revision of the same
//! instance or are told to list again (OUT_OF_RANGE).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use meshwarp_core::node::Node;
use meshwarp_core::table::Replaced;
use meshwarp_core::tc::{Direction as TcDirection, IfaceRef, InstalledRoute, Prefix, TcDataplane};
use meshwarp_core::{CaptureRule, Dataplane, EndpointPair, LatencyScope, PluginChain};
use meshwarp_core::{Outcome, Registered};
use tokio::sync::broadcast;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::convert::{self, RulePb, Violations};
use crate::metrics::Metrics;
use crate::pb::node_service_server::NodeService;
use crate::pb::{self, watch_response::Resource, EventType};
use crate::status::{from_latency, from_plugin, from_rule, from_tc, invalid, invalid_field};

/// Limits and identity of one server instance. Every limit answers with its
/// value named: RESOURCE_EXHAUSTED for a size or count beyond it,
/// INVALID_ARGUMENT for a field too large.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Largest batch accepted (RESOURCE_EXHAUSTED beyond).
    pub max_batch_size: usize,
    /// Events kept for Watch resumption; never fewer than `max_batch_size`,
    /// so that one batch cannot push a watcher out of the history.
    pub event_history: usize,
    /// Largest request message (RESOURCE_EXHAUSTED beyond).
    pub max_message_bytes: usize,
    /// Largest plugin object (INVALID_ARGUMENT beyond).
    pub max_plugin_bytes: usize,
    /// Watch streams open at once (RESOURCE_EXHAUSTED beyond).
    pub max_watchers: usize,
    /// Watch streams one caller (identity) may hold open, so one caller
    /// cannot take every slot (RESOURCE_EXHAUSTED beyond).
    pub max_watchers_per_caller: usize,
    /// Concurrent HTTP/2 streams per connection.
    pub max_concurrent_streams: u32,
    /// How long a unary RPC may take (the client's deadline when shorter).
    pub request_timeout: std::time::Duration,
    /// Reported by GetNodeInfo.
    pub version: String,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_batch_size: 10_000,
            event_history: 16_384,
            max_message_bytes: 8 << 20,
            max_plugin_bytes: 1 << 20,
            max_watchers: 64,
            max_watchers_per_caller: 16,
            max_concurrent_streams: 128,
            request_timeout: std::time::Duration::from_secs(60),
            version: env!("CARGO_PKG_VERSION").into(),
        }
    }
}

impl ServerConfig {
    /// The history actually kept: at least one whole batch.
    pub fn history(&self) -> usize {
        self.event_history.max(self.max_batch_size)
    }
}

#[derive(Debug)]
struct LogInner {
    revision: u64,
    history: VecDeque<pb::WatchResponse>,
}

/// Revisions and recent events; its lock serializes all changes so revisions
/// follow the order changes were applied.
#[derive(Debug)]
pub struct EventLog {
    inner: Mutex<LogInner>,
    tx: broadcast::Sender<pb::WatchResponse>,
    instance_id: String,
    cap: usize,
}

impl EventLog {
    pub fn new(cap: usize) -> Self {
        let (tx, _) = broadcast::channel(cap.max(16));
        Self {
            inner: Mutex::new(LogInner { revision: 0, history: VecDeque::new() }),
            tx,
            instance_id: uuid::Uuid::new_v4().to_string(),
            cap: cap.max(1),
        }
    }

    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    fn lock(&self) -> MutexGuard<'_, LogInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn revision(&self) -> u64 {
        self.lock().revision
    }

    fn push(&self, inner: &mut LogInner, ty: EventType, resource: Resource) -> u64 {
        inner.revision += 1;
        let ev = pb::WatchResponse {
            revision: inner.revision,
            instance_id: self.instance_id.clone(),
            r#type: ty as i32,
            resource: Some(resource),
        };
        if inner.history.len() == self.cap {
            inner.history.pop_front();
        }
        inner.history.push_back(ev.clone());
        // No receivers is fine.
        let _ = self.tx.send(ev);
        inner.revision
    }
}

/// Turns the reader guard's incidents into Watch events (with the rule that
/// covers the connection) and metrics, for as long as the data path lives.
fn forward_incidents(dp: &Arc<Dataplane>, log: &Arc<EventLog>, metrics: &Arc<Metrics>) {
    let rx = dp.incidents();
    let (dp, log, metrics) = (Arc::downgrade(dp), Arc::clone(log), Arc::clone(metrics));
    let spawned = std::thread::Builder::new().name("meshwarp-incidents".into()).spawn(move || {
        for i in rx {
            let Some(dp) = dp.upgrade() else { return };
            let rule = i.rule_id.and_then(|id| dp.registry().rule_by_id(id));
            metrics.incident(&i);
            let mut inner = log.lock();
            log.push(&mut inner, EventType::Incident, Resource::Incident(convert::incident_to_pb(&i, rule)));
        }
    });
    if let Err(e) = spawned {
        tracing::error!("incidents will not reach Watch: {e}");
    }
}

/// The gRPC service.
#[derive(Debug, Clone)]
pub struct NodeServer {
    dp: Arc<Dataplane>,
    /// The tc data path, or why the node has none.
    tc: Result<Arc<TcDataplane>, String>,
    log: Arc<EventLog>,
    cfg: ServerConfig,
    draining: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    /// The plugin chains of both data paths, or why there are none.
    plugins: Result<Arc<PluginChain>, String>,
    /// Orders plugin changes among themselves (load, unload, config), so
    /// their events follow the order they were applied, without holding the
    /// event log across a verifier run or an RCU grace period.
    plugin_ops: Arc<Mutex<()>>,
    /// Watch streams open now (at most `cfg.max_watchers`, and
    /// `cfg.max_watchers_per_caller` per caller).
    watchers: Arc<Mutex<WatchCounts>>,
    /// Held (read) by every RPC body until it returns, also when the client
    /// went away; the drain takes it (write) so that nothing still changes
    /// maps or pins when the daemon stops or cleans up.
    inflight: Arc<tokio::sync::RwLock<()>>,
    /// SyncOwner's generation and lease per owner (this daemon's memory).
    owners: Arc<Mutex<HashMap<String, OwnerState>>>,
}

/// What the node keeps of one owner's SyncOwner calls.
#[derive(Debug, Clone, Copy)]
struct OwnerState {
    generation: u64,
    /// Its length, and when it ends unless renewed.
    lease: Option<(Duration, Instant)>,
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchResponse, Status>> + Send>>;
type LatencyStream = Pin<Box<dyn Stream<Item = Result<pb::WatchLatencyResponse, Status>> + Send>>;

/// Parses every item of a batch, collecting all violations with their index.
fn parse_all<P, T>(
    field: &str,
    items: &[P],
    parse: impl Fn(&str, Option<&P>) -> Result<T, Violations>,
) -> Result<Vec<T>, Violations> {
    let mut v = Violations::default();
    let mut out = Vec::with_capacity(items.len());
    for (i, x) in items.iter().enumerate() {
        match parse(&format!("{field}[{i}]"), Some(x)) {
            Ok(t) => out.push(t),
            Err(e) => v.0.extend(e.0),
        }
    }
    v.into_result(out)
}

/// Open Watch streams: in all and per caller.
#[derive(Debug, Default)]
struct WatchCounts {
    total: usize,
    per_caller: std::collections::HashMap<String, usize>,
}

/// One open Watch stream, counted until dropped.
struct WatcherSlot {
    counts: Arc<Mutex<WatchCounts>>,
    caller: String,
}

impl WatcherSlot {
    fn take(counts: &Arc<Mutex<WatchCounts>>, caller: &str, cfg: &ServerConfig) -> Result<Self, Status> {
        let mut c = counts.lock().unwrap_or_else(|p| p.into_inner());
        let (max, mine) = (cfg.max_watchers, c.per_caller.get(caller).copied().unwrap_or(0));
        if c.total >= max {
            return Err(Status::resource_exhausted(format!(
                "{} Watch streams are open, the limit is {max} (max_watchers)",
                c.total
            )));
        }
        if mine >= cfg.max_watchers_per_caller {
            return Err(Status::resource_exhausted(format!(
                "{caller} has {mine} Watch streams open, the limit is {} (max_watchers_per_caller)",
                cfg.max_watchers_per_caller
            )));
        }
        c.total += 1;
        *c.per_caller.entry(caller.to_string()).or_default() += 1;
        Ok(Self { counts: Arc::clone(counts), caller: caller.to_string() })
    }
}

impl Drop for WatcherSlot {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.total -= 1;
        if let Some(n) = c.per_caller.get_mut(&self.caller) {
            *n -= 1;
            if *n == 0 {
                c.per_caller.remove(&self.caller);
            }
        }
    }
}

fn event_type(o: Outcome) -> Option<EventType> {
    match o {
        Outcome::Created => Some(EventType::Created),
        Outcome::Updated => Some(EventType::Updated),
        Outcome::Unchanged => None,
    }
}

/// The ids of the rules a selector names; none named: empty (every rule).
/// One page of a List of rules: the rules, the node revision it reflects,
/// the instance and the next page's token.
struct RulePage<T> {
    rules: Vec<T>,
    revision: u64,
    instance_id: String,
    next: String,
}

/// The most a List response holds (page_size).
const MAX_LIST_PAGE: u32 = 1000;

/// One page of `items` (each with its page key, unique within the list):
/// those whose key follows `token`'s, in key order, at most `size` (0: all);
/// and the token of the next page (empty: this is the last).
fn page<T>(mut items: Vec<(String, T)>, size: u32, token: &str) -> Result<(Vec<T>, String), Status> {
    if size > MAX_LIST_PAGE {
        return Err(invalid_field("page_size", format!("{size} is more than {MAX_LIST_PAGE}")));
    }
    let after = if token.is_empty() {
        None
    } else {
        let bad = || invalid_field("page_token", "not a token this service returned");
        let bytes: Vec<u8> = (0..token.len())
            .step_by(2)
            .map(|i| token.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
            .collect::<Option<_>>()
            .ok_or_else(bad)?;
        Some(String::from_utf8(bytes).map_err(|_| bad())?)
    };
    items.sort_by(|a, b| a.0.cmp(&b.0));
    let mut rest = items.into_iter().filter(|(k, _)| after.as_ref().is_none_or(|a| k > a)).peekable();
    let take = if size == 0 { usize::MAX } else { size as usize };
    let mut out = Vec::new();
    let mut last = String::new();
    while out.len() < take {
        let Some((k, t)) = rest.next() else { break };
        last = k;
        out.push(t);
    }
    let next = if rest.peek().is_some() { last.bytes().map(|b| format!("{b:02x}")).collect() } else { String::new() };
    Ok((out, next))
}

/// A Watch event to append: what happened, to what.
type Event = (EventType, Resource);

/// The Watch events of one kind's part of a sync: its removals, and its
/// creations and updates.
fn rule_events<R: RulePb>(done: &Replaced<R>, owner: &str) -> (Vec<Event>, Vec<Event>) {
    let event = |ty, rule: &R| (ty, R::resource(R::to_pb(&Registered { rule: *rule, owner: owner.to_string() })));
    let gone = done.deleted.iter().map(|e| (EventType::Deleted, R::resource(R::to_pb(&e.registered())))).collect();
    let created = done.created.iter().map(|r| event(EventType::Created, r));
    let updated = done.updated.iter().map(|(r, _)| event(EventType::Updated, r));
    (gone, created.chain(updated).collect())
}

fn sync_counts(created: usize, updated: usize, deleted: usize, unchanged: usize) -> pb::SyncCounts {
    pb::SyncCounts {
        created: created as u32,
        updated: updated as u32,
        deleted: deleted as u32,
        unchanged: unchanged as u32,
    }
}

/// The body of a SyncOwner request, every violation reported together.
type SyncBody = (Vec<EndpointPair>, Vec<CaptureRule>, Vec<meshwarp_core::tc::InterfaceRoute>);

fn parse_sync(r: &pb::SyncOwnerRequest) -> Result<SyncBody, Violations> {
    let mut v = Violations::default();
    if r.generation == 0 {
        v.add("generation", "must be at least 1");
    }
    let pairs = parse_all("pairs", &r.pairs, EndpointPair::from_pb);
    let captures = parse_all("capture_rules", &r.capture_rules, CaptureRule::from_pb);
    let routes = parse_all("routes", &r.routes, convert::route_from_pb);
    match (pairs, captures, routes) {
        (Ok(p), Ok(c), Ok(t)) => v.into_result((p, c, t)),
        (p, c, t) => {
            for e in [p.err(), c.err(), t.err()].into_iter().flatten() {
                v.0.extend(e.0);
            }
            Err(v)
        }
    }
}

/// What a latency request selects (see `NodeServer::latency_selection`).
struct LatencySelection {
    all: bool,
    rules: BTreeSet<u32>,
    routes: BTreeSet<u32>,
}

fn selected_rules(
    reg: &meshwarp_core::registry::Registry<meshwarp_core::maps::KernelMaps>,
    sel: Option<&pb::RuleSelector>,
) -> Result<BTreeSet<u32>, Status> {
    let Some(sel) = sel else { return Ok(BTreeSet::new()) };
    let mut v = Violations::default();
    let mut ids = BTreeSet::new();
    for (i, k) in sel.pairs.iter().enumerate() {
        match EndpointPair::from_key(&format!("rules.pairs[{i}]"), Some(k)) {
            Ok(p) => ids.insert(reg.id_of(&p).map_err(|e| from_rule(&e))?),
            Err(e) => {
                v.0.extend(e.0);
                continue;
            }
        };
    }
    for (i, k) in sel.capture_rules.iter().enumerate() {
        match CaptureRule::from_key(&format!("rules.capture_rules[{i}]"), Some(k)) {
            Ok(r) => ids.insert(reg.id_of(&r).map_err(|e| from_rule(&e))?),
            Err(e) => {
                v.0.extend(e.0);
                continue;
            }
        };
    }
    v.into_result(ids).map_err(|v| invalid(&v))
}

impl NodeServer {
    /// Serves `node`: its socket family, and its tc family and plugin
    /// chains where it has them.
    pub fn new(node: Node, cfg: ServerConfig, metrics: Arc<Metrics>) -> Self {
        let Node { dataplane: dp, tc, plugins } = node;
        let log = Arc::new(EventLog::new(cfg.history()));
        forward_incidents(&dp, &log, &metrics);
        Self {
            dp,
            tc,
            log,
            cfg,
            draining: Arc::new(AtomicBool::new(false)),
            metrics,
            plugins,
            plugin_ops: Arc::new(Mutex::new(())),
            watchers: Arc::default(),
            inflight: Arc::new(tokio::sync::RwLock::new(())),
            owners: Arc::default(),
        }
    }

    /// The tc family, where this node has it.
    pub fn tc_family(&self) -> Option<Arc<TcDataplane>> {
        self.tc.as_ref().ok().cloned()
    }

    /// The node's plugin chains, if it has them.
    pub fn plugins(&self) -> Option<Arc<PluginChain>> {
        self.plugins.as_ref().ok().cloned()
    }

    fn plugin_chain(&self) -> Result<&PluginChain, Status> {
        self.plugins.as_deref().map_err(|why| Status::failed_precondition(format!("plugins are unavailable: {why}")))
    }

    fn load_plugin(&self, r: pb::LoadPluginRequest) -> Result<pb::LoadPluginResponse, Status> {
        let manifest = self.mutation(&r.owner, convert::manifest_from_pb("manifest", r.manifest.as_ref()))?;
        if r.object.is_empty() {
            return Err(invalid_field("object", "required: the plugin's BPF ELF object"));
        }
        if r.object.len() > self.cfg.max_plugin_bytes {
            return Err(invalid_field(
                "object",
                format!(
                    "{} bytes is more than the limit of {} bytes (max_plugin_bytes)",
                    r.object.len(),
                    self.cfg.max_plugin_bytes
                ),
            ));
        }
        let chain = self.plugin_chain()?;
        let _ops = self.plugin_ops.lock().unwrap_or_else(|p| p.into_inner());
        let replaced = r.replace && chain.get(&manifest.name).is_ok();
        let info = chain.load(&manifest, &r.object, &r.config, r.replace, &r.owner).map_err(|e| from_plugin(&e))?;
        let out = convert::plugin_to_pb(&info);
        let mut log = self.log.lock();
        let ty = if replaced { EventType::Updated } else { EventType::Created };
        self.log.push(&mut log, ty, Resource::Plugin(out.clone()));
        Ok(pb::LoadPluginResponse { plugin: Some(out), replaced })
    }

    fn unload_plugin(&self, r: pb::UnloadPluginRequest) -> Result<pb::UnloadPluginResponse, Status> {
        self.mutation(&r.owner, Ok(()))?;
        let chain = self.plugin_chain()?;
        let _ops = self.plugin_ops.lock().unwrap_or_else(|p| p.into_inner());
        let info = match chain.get(&r.name) {
            Ok(i) => i,
            Err(meshwarp_core::PluginError::NotFound { .. }) if r.allow_missing => {
                return Ok(pb::UnloadPluginResponse { unloaded: false })
            }
            Err(e) => return Err(from_plugin(&e)),
        };
        chain.unload(&r.name, Some(&r.owner)).map_err(|e| from_plugin(&e))?;
        let mut log = self.log.lock();
        self.log.push(&mut log, EventType::Deleted, Resource::Plugin(convert::plugin_to_pb(&info)));
        Ok(pb::UnloadPluginResponse { unloaded: true })
    }

    fn list_plugins(&self, _r: pb::ListPluginsRequest) -> Result<pb::ListPluginsResponse, Status> {
        let list = self.plugin_chain()?.list().map_err(|e| from_plugin(&e))?;
        Ok(pb::ListPluginsResponse { plugins: list.iter().map(convert::plugin_to_pb).collect() })
    }

    fn update_plugin_config(&self, r: pb::UpdatePluginConfigRequest) -> Result<pb::UpdatePluginConfigResponse, Status> {
        self.mutation(&r.owner, Ok(()))?;
        let chain = self.plugin_chain()?;
        let _ops = self.plugin_ops.lock().unwrap_or_else(|p| p.into_inner());
        let info = chain.update_config(&r.name, &r.config, Some(&r.owner)).map_err(|e| from_plugin(&e))?;
        let out = convert::plugin_to_pb(&info);
        let mut log = self.log.lock();
        self.log.push(&mut log, EventType::Updated, Resource::Plugin(out.clone()));
        Ok(pb::UpdatePluginConfigResponse { plugin: Some(out) })
    }

    fn tc(&self) -> Result<&TcDataplane, Status> {
        self.tc
            .as_deref()
            .map_err(|why| Status::failed_precondition(format!("tc redirection is unavailable on this node: {why}")))
    }

    /// Takes routes whose interfaces vanished out of the data path and
    /// announces them as STALE; the daemon calls this periodically.
    /// Runs `body` on tokio's blocking pool (map updates are system calls,
    /// a plugin load runs the verifier and waits for an RCU grace period, a
    /// route looks interfaces up over netlink), never on an async worker;
    /// it holds an `inflight` read guard until it returns, so the drain
    /// waits for it even when its caller went away.
    async fn blocking<T: Send + 'static>(
        &self,
        what: &str,
        body: impl FnOnce(NodeServer) -> Result<T, Status> + Send + 'static,
    ) -> Result<T, Status> {
        let inflight = Arc::clone(&self.inflight).read_owned().await;
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let _inflight = inflight;
            body(this)
        })
        .await
        .unwrap_or_else(|e| Err(Status::internal(format!("{what}: {e}"))))
    }

    /// [`Self::refresh_routes`] as an RPC body would run it.
    pub async fn refresh_routes_now(&self) -> Result<usize, Status> {
        self.blocking("refreshing routes", |this| this.refresh_routes()).await
    }

    pub fn refresh_routes(&self) -> Result<usize, Status> {
        let tc = self.tc()?;
        let mut log = self.log.lock();
        let stale = tc.refresh().map_err(|e| from_tc(&e))?;
        for s in &stale {
            let r = convert::route_to_pb(&s.route, Some(&s.reason));
            self.log.push(&mut log, EventType::Stale, Resource::Route(r));
        }
        Ok(stale.len())
    }

    fn find_route(
        &self,
        tc: &TcDataplane,
        key: &(IfaceRef, TcDirection, Prefix),
    ) -> Result<Option<InstalledRoute>, Status> {
        let ifindex = tc.resolve_iface(&key.0).map_err(|e| from_tc(&e))?;
        Ok(tc
            .routes()
            .into_iter()
            .find(|r| r.attach_ifindex == ifindex && r.route.direction == key.1 && r.route.dst == key.2))
    }

    fn create_route(&self, r: pb::CreateRouteRequest) -> Result<pb::CreateRouteResponse, Status> {
        let route = self.mutation(&r.owner, convert::route_from_pb("route", r.route.as_ref()))?;
        let tc = self.tc()?;
        let mut log = self.log.lock();
        let installed = tc.insert_route(&route, &r.owner).map_err(|e| from_tc(&e))?;
        let out = convert::route_to_pb(&installed, None);
        let revision = self.log.push(&mut log, EventType::Created, Resource::Route(out.clone()));
        Ok(pb::CreateRouteResponse { route: Some(out), revision })
    }

    fn update_route(&self, r: pb::UpdateRouteRequest) -> Result<pb::UpdateRouteResponse, Status> {
        let route = self.mutation(&r.owner, convert::route_from_pb("route", r.route.as_ref()))?;
        let tc = self.tc()?;
        let mut log = self.log.lock();
        if !r.allow_missing && self.find_route(tc, &(route.attach.clone(), route.direction, route.dst))?.is_none() {
            return Err(Status::not_found(format!("route {route} is not registered")));
        }
        let (installed, outcome) = tc.upsert_route(&route, &r.owner).map_err(|e| from_tc(&e))?;
        let out = convert::route_to_pb(&installed, None);
        let revision = match event_type(outcome) {
            Some(t) => self.log.push(&mut log, t, Resource::Route(out.clone())),
            None => log.revision,
        };
        Ok(pb::UpdateRouteResponse { route: Some(out), revision, created: outcome == Outcome::Created })
    }

    fn delete_route(&self, r: pb::DeleteRouteRequest) -> Result<pb::DeleteRouteResponse, Status> {
        let key = self.mutation(&r.owner, convert::route_key_from_pb("key", r.key.as_ref()))?;
        let tc = self.tc()?;
        let mut log = self.log.lock();
        match tc.delete_route(&key.0, key.1, key.2, Some(&r.owner)) {
            Ok(gone) => {
                let revision =
                    self.log.push(&mut log, EventType::Deleted, Resource::Route(convert::route_to_pb(&gone, None)));
                Ok(pb::DeleteRouteResponse { revision, deleted: true })
            }
            Err(meshwarp_core::tc::TcError::Rule(meshwarp_core::RuleError::NotFound(_))) if r.allow_missing => {
                Ok(pb::DeleteRouteResponse { revision: log.revision, deleted: false })
            }
            Err(e) => Err(from_tc(&e)),
        }
    }

    fn get_route(&self, r: pb::GetRouteRequest) -> Result<pb::GetRouteResponse, Status> {
        let key = convert::route_key_from_pb("key", r.key.as_ref()).map_err(|v| invalid(&v))?;
        let tc = self.tc()?;
        let found =
            self.find_route(tc, &key)?.ok_or_else(|| Status::not_found(format!("route {} on {}", key.2, key.0)))?;
        let st = tc.route_stats(&found).map_err(|e| from_tc(&e))?;
        Ok(pb::GetRouteResponse {
            route: Some(convert::route_to_pb(&found, None)),
            counters: Some(pb::RouteCounters {
                packets: st.packets,
                bytes: st.bytes,
                redirect_errors: st.redirect_err,
            }),
        })
    }

    fn list_routes(&self, r: pb::ListRoutesRequest) -> Result<pb::ListRoutesResponse, Status> {
        let tc = self.tc()?;
        let log = self.log.lock();
        let mine = |o: &str| r.owner.is_empty() || o == r.owner;
        // Page keys: attach point, direction, destination; stale ones apart.
        let key = |x: &InstalledRoute, stale: &str| {
            format!("{:010}|{:?}|{}{stale}", x.attach_ifindex, x.route.direction, x.route.dst)
        };
        let mut routes: Vec<_> = tc
            .routes()
            .iter()
            .filter(|x| mine(&x.owner))
            .map(|x| (key(x, ""), convert::route_to_pb(x, None)))
            .collect();
        if r.include_stale {
            routes.extend(
                tc.stale_routes()
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| mine(&s.route.owner))
                    // The same route can go stale twice: its place makes the key unique.
                    .map(|(i, s)| {
                        (key(&s.route, &format!("|stale{i:06}")), convert::route_to_pb(&s.route, Some(&s.reason)))
                    }),
            );
        }
        let (routes, next_page_token) = page(routes, r.page_size, &r.page_token)?;
        Ok(pb::ListRoutesResponse {
            routes,
            revision: log.revision,
            instance_id: self.log.instance_id.clone(),
            next_page_token,
        })
    }

    fn batch_upsert_routes(&self, r: pb::BatchUpsertRoutesRequest) -> Result<pb::BatchUpsertRoutesResponse, Status> {
        self.serving()?;
        self.batch_size("routes", r.routes.len())?;
        let routes = self.mutation(&r.owner, parse_all("routes", &r.routes, convert::route_from_pb))?;
        let tc = self.tc()?;
        let mut log = self.log.lock();
        let out = tc.batch_upsert_routes(&routes, &r.owner).map_err(|e| from_tc(&e))?;
        let mut resp = pb::BatchUpsertRoutesResponse::default();
        for (installed, o) in &out {
            match o {
                Outcome::Created => resp.created += 1,
                Outcome::Updated => resp.updated += 1,
                Outcome::Unchanged => resp.unchanged += 1,
            }
            if let Some(t) = event_type(*o) {
                self.log.push(&mut log, t, Resource::Route(convert::route_to_pb(installed, None)));
            }
        }
        resp.revision = log.revision;
        Ok(resp)
    }

    fn batch_delete_routes(&self, r: pb::BatchDeleteRoutesRequest) -> Result<pb::BatchDeleteRoutesResponse, Status> {
        self.serving()?;
        self.batch_size("keys", r.keys.len())?;
        let keys = self.mutation(&r.owner, parse_all("keys", &r.keys, convert::route_key_from_pb))?;
        let tc = self.tc()?;
        let mut log = self.log.lock();
        let gone = tc.batch_delete_routes(&keys, &r.owner, r.allow_missing).map_err(|e| from_tc(&e))?;
        let mut n = 0;
        for g in gone.iter().flatten() {
            n += 1;
            self.log.push(&mut log, EventType::Deleted, Resource::Route(convert::route_to_pb(g, None)));
        }
        Ok(pb::BatchDeleteRoutesResponse { revision: log.revision, deleted: n })
    }

    fn attach_interface(&self, r: pb::AttachInterfaceRequest) -> Result<pb::AttachInterfaceResponse, Status> {
        self.serving()?;
        let i = convert::iface_from_pb("iface", r.iface.as_ref()).map_err(|v| invalid(&v))?;
        let d = convert::direction_from_pb("direction", r.direction).map_err(|v| invalid(&v))?;
        let (ifindex, mode) = self.tc()?.attach(&i, d).map_err(|e| match e {
            meshwarp_core::tc::TcError::Netlink(meshwarp_core::netlink::NetlinkError::NoSuchInterface(n)) => {
                invalid_field("iface", format!("unknown interface {n}"))
            }
            other => from_tc(&other),
        })?;
        let mode = match mode {
            meshwarp_core::tc::AttachMode::Tcx => "tcx",
            meshwarp_core::tc::AttachMode::Clsact => "clsact",
        };
        Ok(pb::AttachInterfaceResponse { ifindex, mode: mode.into() })
    }

    fn detach_interface(&self, r: pb::DetachInterfaceRequest) -> Result<pb::DetachInterfaceResponse, Status> {
        self.serving()?;
        let i = convert::iface_from_pb("iface", r.iface.as_ref()).map_err(|v| invalid(&v))?;
        let d = convert::direction_from_pb("direction", r.direction).map_err(|v| invalid(&v))?;
        let tc = self.tc()?;
        let ifindex = tc.resolve_iface(&i).map_err(|e| from_tc(&e))?;
        match tc.detach(ifindex, d) {
            Ok(()) => Ok(pb::DetachInterfaceResponse { detached: true }),
            Err(meshwarp_core::tc::TcError::Rule(meshwarp_core::RuleError::NotFound(_))) if r.allow_missing => {
                Ok(pb::DetachInterfaceResponse { detached: false })
            }
            Err(e) => Err(from_tc(&e)),
        }
    }

    fn list_attachments(&self, _r: pb::ListAttachmentsRequest) -> Result<pb::ListAttachmentsResponse, Status> {
        let tc = self.tc()?;
        let mut out = Vec::new();
        for (ifindex, d) in tc.attachments() {
            let st = tc.attach_stats(ifindex, d).map_err(|e| from_tc(&e))?;
            out.push(pb::Attachment {
                ifindex,
                direction: convert::direction_to_pb(d),
                packets: st.packets,
                misses: st.misses,
            });
        }
        Ok(pb::ListAttachmentsResponse { attachments: out })
    }

    pub fn instance_id(&self) -> &str {
        self.log.instance_id()
    }

    /// Waits until no RPC body runs any more (those the drain timeout cut
    /// off included); while the returned guard lives no new one starts.
    /// `None` if `timeout` passed first.
    pub async fn wait_idle(&self, timeout: std::time::Duration) -> Option<tokio::sync::OwnedRwLockWriteGuard<()>> {
        tokio::time::timeout(timeout, Arc::clone(&self.inflight).write_owned()).await.ok()
    }

    /// From now on RPCs answer UNAVAILABLE (the daemon is stopping).
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn dataplane(&self) -> &Arc<Dataplane> {
        &self.dp
    }

    fn serving(&self) -> Result<(), Status> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(Status::unavailable("meshwarp node service is draining; retry against the next instance"));
        }
        Ok(())
    }

    /// The prologue of every mutating RPC: the node is serving, and the owner
    /// and the parsed body are valid; all violations are reported together.
    fn mutation<T>(&self, owner: &str, parsed: Result<T, Violations>) -> Result<T, Status> {
        self.serving()?;
        let mut v = Violations::default();
        convert::owner(&mut v, "owner", owner);
        match parsed {
            Ok(t) if v.is_empty() => Ok(t),
            Ok(_) => Err(invalid(&v)),
            Err(e) => {
                v.0.extend(e.0);
                Err(invalid(&v))
            }
        }
    }

    fn batch_size(&self, field: &str, n: usize) -> Result<(), Status> {
        if n == 0 {
            return Err(invalid_field(field, "empty batch"));
        }
        if n > self.cfg.max_batch_size {
            return Err(Status::resource_exhausted(format!(
                "batch of {n} exceeds the limit of {} entries",
                self.cfg.max_batch_size
            )));
        }
        Ok(())
    }

    /// Runs an RPC body, recording its code and latency.
    fn observed<T>(&self, method: &str, start: Instant, r: Result<T, Status>) -> Result<Response<T>, Status> {
        let code = r.as_ref().map(|_| tonic::Code::Ok).unwrap_or_else(|s| s.code());
        self.metrics.observe(method, code, start.elapsed());
        r.map(Response::new)
    }

    fn create_rule<R: RulePb>(&self, owner: &str, parsed: Result<R, Violations>) -> Result<(R::Pb, u64), Status> {
        let rule = self.mutation(owner, parsed)?;
        let mut log = self.log.lock();
        self.dp.registry().insert(&rule, owner).map_err(|e| from_rule(&e))?;
        let out = R::to_pb(&Registered { rule, owner: owner.to_string() });
        let revision = self.log.push(&mut log, EventType::Created, R::resource(out.clone()));
        Ok((out, revision))
    }

    /// Returns the rule, the revision and whether it was created.
    fn update_rule<R: RulePb>(
        &self,
        owner: &str,
        parsed: Result<R, Violations>,
        allow_missing: bool,
    ) -> Result<(R::Pb, u64, bool), Status> {
        let rule = self.mutation(owner, parsed)?;
        let mut log = self.log.lock();
        let mut reg = self.dp.registry();
        if !allow_missing {
            reg.get(&rule).map_err(|e| from_rule(&e))?;
        }
        let outcome = reg.upsert(&rule, owner).map_err(|e| from_rule(&e))?;
        drop(reg);
        let out = R::to_pb(&Registered { rule, owner: owner.to_string() });
        let revision = match event_type(outcome) {
            Some(t) => self.log.push(&mut log, t, R::resource(out.clone())),
            None => log.revision,
        };
        Ok((out, revision, outcome == Outcome::Created))
    }

    /// Returns the revision and whether a rule was deleted.
    fn delete_rule<R: RulePb>(
        &self,
        owner: &str,
        key: Result<R, Violations>,
        allow_missing: bool,
    ) -> Result<(u64, bool), Status> {
        let key = self.mutation(owner, key)?;
        let mut log = self.log.lock();
        let mut reg = self.dp.registry();
        // The event carries the rule as it was (a key names fewer fields).
        let existing = match reg.get(&key) {
            Ok(e) => e,
            Err(meshwarp_core::RuleError::NotFound(_)) if allow_missing => return Ok((log.revision, false)),
            Err(e) => return Err(from_rule(&e)),
        };
        reg.remove(&key, Some(owner)).map_err(|e| from_rule(&e))?;
        drop(reg);
        let revision = self.log.push(&mut log, EventType::Deleted, R::resource(R::to_pb(&existing)));
        Ok((revision, true))
    }

    fn get_rule<R: RulePb>(&self, key: Result<R, Violations>) -> Result<(R::Pb, pb::RuleCounters), Status> {
        let key = key.map_err(|v| invalid(&v))?;
        let reg = self.dp.registry();
        let got = reg.get(&key).map_err(|e| from_rule(&e))?;
        let counters = reg.stats(&key).map_err(|e| from_rule(&e))?;
        Ok((R::to_pb(&got), convert::counters_to_pb(&counters)))
    }

    /// The rules of `owner` (all when empty), the revision and the instance.
    /// One page of the rules of kind `R` (of `owner`, or all).
    fn list_rules<R: RulePb>(&self, owner: &str, size: u32, token: &str) -> Result<RulePage<R::Pb>, Status> {
        let log = self.log.lock();
        let rules: Vec<_> = self
            .dp
            .registry()
            .list::<R>()
            .into_iter()
            .filter(|r| owner.is_empty() || r.owner == owner)
            .map(|r| (format!("{:?}", meshwarp_core::table::Rule::rule_key(&r.rule)), R::to_pb(&r)))
            .collect();
        let (rules, next) = page(rules, size, token)?;
        Ok(RulePage { rules, revision: log.revision, instance_id: self.log.instance_id.clone(), next })
    }

    /// Returns (created, updated, unchanged, revision).
    fn batch_upsert_rules<R: RulePb>(
        &self,
        field: &str,
        owner: &str,
        items: &[R::Pb],
    ) -> Result<(u32, u32, u32, u64), Status> {
        self.serving()?;
        self.batch_size(field, items.len())?;
        let rules = self.mutation(owner, parse_all(field, items, R::from_pb))?;
        let mut log = self.log.lock();
        let outcomes = self.dp.registry().batch_upsert(&rules, owner).map_err(|e| from_rule(&e))?;
        let (mut created, mut updated, mut unchanged) = (0, 0, 0);
        for (rule, o) in rules.into_iter().zip(outcomes) {
            match o {
                Outcome::Created => created += 1,
                Outcome::Updated => updated += 1,
                Outcome::Unchanged => unchanged += 1,
            }
            if let Some(t) = event_type(o) {
                let out = R::to_pb(&Registered { rule, owner: owner.to_string() });
                self.log.push(&mut log, t, R::resource(out));
            }
        }
        Ok((created, updated, unchanged, log.revision))
    }

    /// Returns the revision and how many rules were deleted.
    fn batch_delete_rules<R: RulePb>(
        &self,
        owner: &str,
        keys: &[R::PbKey],
        allow_missing: bool,
    ) -> Result<(u64, u32), Status> {
        self.serving()?;
        self.batch_size("keys", keys.len())?;
        let keys = self.mutation(owner, parse_all("keys", keys, R::from_key))?;
        let mut log = self.log.lock();
        let mut reg = self.dp.registry();
        let existing: Vec<_> = keys.iter().map(|k| reg.get(k).ok()).collect();
        let deleted = reg.batch_remove(&keys, owner, allow_missing).map_err(|e| from_rule(&e))?;
        drop(reg);
        let mut n = 0;
        for (e, d) in existing.iter().zip(deleted) {
            if let (Some(e), true) = (e, d) {
                n += 1;
                self.log.push(&mut log, EventType::Deleted, R::resource(R::to_pb(e)));
            }
        }
        Ok((log.revision, n))
    }

    fn create_pair(&self, r: pb::CreatePairRequest) -> Result<pb::CreatePairResponse, Status> {
        let (pair, revision) = self.create_rule(&r.owner, EndpointPair::from_pb("pair", r.pair.as_ref()))?;
        Ok(pb::CreatePairResponse { pair: Some(pair), revision })
    }

    fn update_pair(&self, r: pb::UpdatePairRequest) -> Result<pb::UpdatePairResponse, Status> {
        let parsed = EndpointPair::from_pb("pair", r.pair.as_ref());
        let (pair, revision, created) = self.update_rule(&r.owner, parsed, r.allow_missing)?;
        Ok(pb::UpdatePairResponse { pair: Some(pair), revision, created })
    }

    fn delete_pair(&self, r: pb::DeletePairRequest) -> Result<pb::DeletePairResponse, Status> {
        let key = EndpointPair::from_key("key", r.key.as_ref());
        let (revision, deleted) = self.delete_rule(&r.owner, key, r.allow_missing)?;
        Ok(pb::DeletePairResponse { revision, deleted })
    }

    fn get_pair(&self, r: pb::GetPairRequest) -> Result<pb::GetPairResponse, Status> {
        let (pair, counters) = self.get_rule(EndpointPair::from_key("key", r.key.as_ref()))?;
        Ok(pb::GetPairResponse { pair: Some(pair), counters: Some(counters) })
    }

    fn list_pairs(&self, r: pb::ListPairsRequest) -> Result<pb::ListPairsResponse, Status> {
        let p = self.list_rules::<EndpointPair>(&r.owner, r.page_size, &r.page_token)?;
        Ok(pb::ListPairsResponse {
            pairs: p.rules,
            revision: p.revision,
            instance_id: p.instance_id,
            next_page_token: p.next,
        })
    }

    fn batch_upsert_pairs(&self, r: pb::BatchUpsertPairsRequest) -> Result<pb::BatchUpsertPairsResponse, Status> {
        let (created, updated, unchanged, revision) =
            self.batch_upsert_rules::<EndpointPair>("pairs", &r.owner, &r.pairs)?;
        Ok(pb::BatchUpsertPairsResponse { revision, created, updated, unchanged })
    }

    fn batch_delete_pairs(&self, r: pb::BatchDeletePairsRequest) -> Result<pb::BatchDeletePairsResponse, Status> {
        let (revision, deleted) = self.batch_delete_rules::<EndpointPair>(&r.owner, &r.keys, r.allow_missing)?;
        Ok(pb::BatchDeletePairsResponse { revision, deleted })
    }

    fn create_capture(&self, r: pb::CreateCaptureRuleRequest) -> Result<pb::CreateCaptureRuleResponse, Status> {
        let (rule, revision) = self.create_rule(&r.owner, CaptureRule::from_pb("rule", r.rule.as_ref()))?;
        Ok(pb::CreateCaptureRuleResponse { rule: Some(rule), revision })
    }

    fn update_capture(&self, r: pb::UpdateCaptureRuleRequest) -> Result<pb::UpdateCaptureRuleResponse, Status> {
        let parsed = CaptureRule::from_pb("rule", r.rule.as_ref());
        let (rule, revision, created) = self.update_rule(&r.owner, parsed, r.allow_missing)?;
        Ok(pb::UpdateCaptureRuleResponse { rule: Some(rule), revision, created })
    }

    fn delete_capture(&self, r: pb::DeleteCaptureRuleRequest) -> Result<pb::DeleteCaptureRuleResponse, Status> {
        let key = CaptureRule::from_key("key", r.key.as_ref());
        let (revision, deleted) = self.delete_rule(&r.owner, key, r.allow_missing)?;
        Ok(pb::DeleteCaptureRuleResponse { revision, deleted })
    }

    fn get_capture(&self, r: pb::GetCaptureRuleRequest) -> Result<pb::GetCaptureRuleResponse, Status> {
        let (rule, counters) = self.get_rule(CaptureRule::from_key("key", r.key.as_ref()))?;
        Ok(pb::GetCaptureRuleResponse { rule: Some(rule), counters: Some(counters) })
    }

    fn list_captures(&self, r: pb::ListCaptureRulesRequest) -> Result<pb::ListCaptureRulesResponse, Status> {
        let p = self.list_rules::<CaptureRule>(&r.owner, r.page_size, &r.page_token)?;
        Ok(pb::ListCaptureRulesResponse {
            rules: p.rules,
            revision: p.revision,
            instance_id: p.instance_id,
            next_page_token: p.next,
        })
    }

    fn batch_upsert_captures(
        &self,
        r: pb::BatchUpsertCaptureRulesRequest,
    ) -> Result<pb::BatchUpsertCaptureRulesResponse, Status> {
        let (created, updated, unchanged, revision) =
            self.batch_upsert_rules::<CaptureRule>("rules", &r.owner, &r.rules)?;
        Ok(pb::BatchUpsertCaptureRulesResponse { revision, created, updated, unchanged })
    }

    fn batch_delete_captures(
        &self,
        r: pb::BatchDeleteCaptureRulesRequest,
    ) -> Result<pb::BatchDeleteCaptureRulesResponse, Status> {
        let (revision, deleted) = self.batch_delete_rules::<CaptureRule>(&r.owner, &r.keys, r.allow_missing)?;
        Ok(pb::BatchDeleteCaptureRulesResponse { revision, deleted })
    }

    fn stats(&self, _r: pb::GetStatsRequest) -> Result<pb::GetStatsResponse, Status> {
        let reg = self.dp.registry();
        let global = reg.global_stats().map_err(|e| from_rule(&e))?;
        let mut resp = pb::GetStatsResponse { global: Some(convert::global_to_pb(&global)), ..Default::default() };
        for p in reg.pairs() {
            let c = reg.stats(&p.rule).map_err(|e| from_rule(&e))?;
            resp.pairs.push(pb::PairStats {
                pair: Some(convert::pair_to_pb(&p)),
                counters: Some(convert::counters_to_pb(&c)),
            });
        }
        for r in reg.captures() {
            let c = reg.stats(&r.rule).map_err(|e| from_rule(&e))?;
            resp.capture_rules.push(pb::CaptureRuleStats {
                rule: Some(convert::capture_to_pb(&r)),
                counters: Some(convert::counters_to_pb(&c)),
            });
        }
        Ok(resp)
    }

    fn watch_stream(&self, r: pb::WatchRequest, caller: String) -> Result<WatchStream, Status> {
        if r.after_revision != 0 && r.instance_id.is_empty() {
            // Revisions count per instance: resuming against another one
            // (after a restart) would silently skip or repeat events.
            return Err(invalid_field("instance_id", "required to resume after a revision (from the List response)"));
        }
        let watcher = WatcherSlot::take(&self.watchers, &caller, &self.cfg)?;
        let log = self.log.lock();
        if !r.instance_id.is_empty() && r.instance_id != self.log.instance_id {
            return Err(Status::out_of_range(format!(
                "instance {} is gone (this node is now {}): list again, then watch",
                r.instance_id, self.log.instance_id
            )));
        }
        let from = if r.after_revision == 0 { log.revision } else { r.after_revision };
        if from > log.revision {
            return Err(Status::out_of_range(format!("revision {from} is ahead of this node ({})", log.revision)));
        }
        let oldest_kept = log.history.front().map(|e| e.revision).unwrap_or(log.revision + 1);
        if from < log.revision && from + 1 < oldest_kept {
            return Err(Status::out_of_range(format!(
                "revision {from} is too old (history starts at {oldest_kept}): list again, then watch"
            )));
        }
        let replay: Vec<_> = log.history.iter().filter(|e| e.revision > from).cloned().map(Ok).collect();
        let last = replay
            .last()
            .map(|e: &Result<pb::WatchResponse, Status>| e.as_ref().map(|x| x.revision).unwrap_or(from))
            .unwrap_or(from);
        // Subscribed while holding the log: no event falls between replay and live.
        let live = BroadcastStream::new(self.log.tx.subscribe()).filter_map(move |e| match e {
            Ok(ev) if ev.revision > last => Some(Ok(ev)),
            Ok(_) => None,
            Err(BroadcastStreamRecvError::Lagged(n)) => {
                Some(Err(Status::out_of_range(format!("watcher fell {n} events behind: list again, then watch"))))
            }
        });
        drop(log);
        // The slot goes with the stream: a watcher that disconnects frees it.
        let stream = tokio_stream::iter(replay).chain(live).map(move |e| {
            let _held = &watcher;
            e
        });
        Ok(Box::pin(stream))
    }

    /// Replaces everything `r.owner` registered with its desired state (see
    /// the proto): the generation is checked, both families change or
    /// neither, and every change is a Watch event.
    fn sync_owner(&self, r: pb::SyncOwnerRequest) -> Result<pb::SyncOwnerResponse, Status> {
        self.sync(r, false).map(|resp| resp.unwrap_or_default())
    }

    /// The body of SyncOwner; with `if_lease_ended`, only if the owner's
    /// lease has ended still (checked under the owners' lock, so a renewal
    /// or a sync that came in meanwhile wins): `None` when it had not.
    fn sync(&self, r: pb::SyncOwnerRequest, if_lease_ended: bool) -> Result<Option<pb::SyncOwnerResponse>, Status> {
        let (pairs, captures, routes) = self.mutation(&r.owner, parse_sync(&r))?;
        for (field, n) in [("pairs", pairs.len()), ("capture_rules", captures.len()), ("routes", routes.len())] {
            if n > self.cfg.max_batch_size {
                return Err(Status::resource_exhausted(format!(
                    "{field}: {n} entries exceed the limit of {}",
                    self.cfg.max_batch_size
                )));
            }
        }
        let tc = match (&self.tc, routes.is_empty()) {
            (Ok(tc), _) => Some(tc.as_ref()),
            (Err(_), true) => None,
            (Err(_), false) => Some(self.tc()?),
        };
        let mut owners = self.owners.lock().unwrap_or_else(|p| p.into_inner());
        if if_lease_ended {
            let ended =
                |o: &OwnerState| o.generation == r.generation && o.lease.is_some_and(|(_, end)| end <= Instant::now());
            if !owners.get(&r.owner).is_some_and(ended) {
                return Ok(None);
            }
        }
        if let Some(last) = owners.get(&r.owner).filter(|o| r.generation < o.generation) {
            return Err(Status::aborted(format!(
                "generation {} of owner {:?} is older than the {} this node applied: nothing changed",
                r.generation, r.owner, last.generation
            )));
        }
        // The routes are checked (interfaces, owners, room) before the rules change.
        if let Some(tc) = tc {
            tc.check_replace(&r.owner, &routes).map_err(|e| from_tc(&e))?;
        }
        let mut log = self.log.lock();
        let mut reg = self.dp.registry();
        let done = reg.begin_replace_owner(&r.owner, &pairs, &captures).map_err(|e| from_rule(&e))?;
        let routes_done = match tc.map(|tc| tc.replace_owner_routes(&r.owner, &routes)) {
            Some(Err(e)) => {
                reg.revert_owner(done);
                return Err(from_tc(&e));
            }
            Some(Ok(t)) => Some(t),
            None => None,
        };
        reg.commit_owner(&done);
        drop(reg);
        // Removals first (both kinds), then creations and updates, then routes.
        let (pair_gone, pair_set) = rule_events(&done.pairs, &r.owner);
        let (capture_gone, capture_set) = rule_events(&done.captures, &r.owner);
        let mut events: Vec<Event> = pair_gone.into_iter().chain(capture_gone).collect();
        events.extend(pair_set.into_iter().chain(capture_set));
        let mut route_counts = pb::SyncCounts::default();
        if let Some(t) = &routes_done {
            let route = |ty, x: &InstalledRoute| (ty, Resource::Route(convert::route_to_pb(x, None)));
            events.extend(t.deleted.iter().map(|x| route(EventType::Deleted, x)));
            events.extend(t.created.iter().map(|x| route(EventType::Created, x)));
            events.extend(t.updated.iter().map(|x| route(EventType::Updated, x)));
            route_counts = sync_counts(t.created.len(), t.updated.len(), t.deleted.len(), t.unchanged);
        }
        let mut changes = Vec::with_capacity(events.len());
        for (ty, res) in events {
            self.log.push(&mut log, ty, res);
            changes.extend(log.history.back().cloned());
        }
        let lease = (r.lease_seconds > 0).then(|| {
            let len = Duration::from_secs(u64::from(r.lease_seconds));
            (len, Instant::now() + len)
        });
        owners.insert(r.owner.clone(), OwnerState { generation: r.generation, lease });
        let (p, c) = (&done.pairs, &done.captures);
        tracing::info!(owner = %r.owner, generation = r.generation, changes = changes.len(), "owner synced");
        Ok(Some(pb::SyncOwnerResponse {
            revision: log.revision,
            instance_id: self.log.instance_id.clone(),
            generation: r.generation,
            pairs: Some(sync_counts(p.created.len(), p.updated.len(), p.deleted.len(), p.unchanged)),
            capture_rules: Some(sync_counts(c.created.len(), c.updated.len(), c.deleted.len(), c.unchanged)),
            routes: Some(route_counts),
            changes,
        }))
    }

    fn renew_lease(&self, r: pb::RenewLeaseRequest) -> Result<pb::RenewLeaseResponse, Status> {
        self.mutation(&r.owner, Ok(()))?;
        let mut owners = self.owners.lock().unwrap_or_else(|p| p.into_inner());
        let st = owners.get_mut(&r.owner).ok_or_else(|| {
            Status::not_found(format!("owner {:?} has no lease here (SyncOwner with lease_seconds first)", r.owner))
        })?;
        let Some((len, _)) = st.lease else {
            return Err(Status::failed_precondition(format!("owner {:?} synced without a lease", r.owner)));
        };
        st.lease = Some((len, Instant::now() + len));
        Ok(pb::RenewLeaseResponse { lease_seconds: len.as_secs() as u32, generation: st.generation })
    }

    /// Removes the rules and routes of every owner whose lease ended (the
    /// controller stopped renewing it); returns those owners.
    pub fn expire_leases(&self) -> Vec<String> {
        let now = Instant::now();
        let expired: Vec<(String, OwnerState)> = {
            let owners = self.owners.lock().unwrap_or_else(|p| p.into_inner());
            owners
                .iter()
                .filter(|(_, o)| o.lease.is_some_and(|(_, end)| end <= now))
                .map(|(k, v)| (k.clone(), *v))
                .collect()
        };
        let mut gone = Vec::new();
        for (owner, st) in expired {
            // Removing is a sync to the empty set at the same generation.
            let req = pb::SyncOwnerRequest { owner: owner.clone(), generation: st.generation, ..Default::default() };
            match self.sync(req, true) {
                Ok(Some(resp)) => {
                    tracing::warn!(%owner, removed = resp.changes.len(), "the owner's lease ended: its rules and routes are removed");
                    gone.push(owner);
                }
                // Renewed or synced again meanwhile.
                Ok(None) => {}
                Err(e) => tracing::warn!(%owner, "removing the rules of an owner whose lease ended: {}", e.message()),
            }
        }
        gone
    }

    /// [`Self::expire_leases`] as an RPC body would run it (a drain waits for it).
    pub async fn expire_leases_now(&self) -> Vec<String> {
        self.blocking("expiring leases", |this| Ok(this.expire_leases())).await.unwrap_or_default()
    }

    /// What a latency selector names: pair and capture rule ids, route ids;
    /// `all` when it names nothing (every rule and route). An unknown key is
    /// NOT_FOUND; a route on a node without tc redirection FAILED_PRECONDITION.
    fn latency_selection(
        &self,
        reg: &meshwarp_core::registry::Registry<meshwarp_core::maps::KernelMaps>,
        sel: Option<&pb::RuleSelector>,
    ) -> Result<LatencySelection, Status> {
        let rules = selected_rules(reg, sel)?;
        let mut routes = BTreeSet::new();
        let keys = sel.map(|s| s.routes.as_slice()).unwrap_or_default();
        if !keys.is_empty() {
            let tc = self.tc()?;
            for (i, k) in keys.iter().enumerate() {
                let key =
                    convert::route_key_from_pb(&format!("rules.routes[{i}]"), Some(k)).map_err(|v| invalid(&v))?;
                let missing = || Status::not_found(format!("route {} on {} is not registered", key.2, key.0));
                // An interface that does not exist has no route either.
                let found = self
                    .find_route(tc, &key)
                    .map_err(|s| if s.code() == tonic::Code::InvalidArgument { missing() } else { s })?
                    .ok_or_else(missing)?;
                routes.insert(found.id());
            }
        }
        Ok(LatencySelection { all: rules.is_empty() && routes.is_empty(), rules, routes })
    }

    fn set_latency(&self, r: pb::SetLatencyRequest) -> Result<pb::SetLatencyResponse, Status> {
        self.mutation(&r.owner, Ok(()))?;
        let sampling = convert::sampling_from_pb(r.sampling).map_err(|v| invalid(&v))?;
        // Rules are not removed while the switch resolves and applies them
        // (rule changes take the registry too).
        let reg = self.dp.registry();
        let sel = self.latency_selection(&reg, r.rules.as_ref())?;
        // A selector that names only routes (or only rules) switches the
        // other family off: the set replaces the previous one.
        let scope = |ids: &BTreeSet<u32>| match (r.enabled, sel.all) {
            (false, _) => LatencyScope::Off,
            (true, true) => LatencyScope::All,
            (true, false) if ids.is_empty() => LatencyScope::Off,
            (true, false) => LatencyScope::Rules(ids.clone()),
        };
        let (rules, routes) = (scope(&sel.rules), scope(&sel.routes));
        let tc = self.tc.as_deref().ok();
        let mon = self.dp.latency();
        let rules_before = mon.scope().map_err(|e| from_latency(&e))?;
        let sampling_before = mon.sampling().map_err(|e| from_latency(&e))?;
        // Sampling first: a monitor switched on now samples as asked from
        // its first message.
        if let Some(s) = sampling {
            mon.set_sampling(s).map_err(|e| from_latency(&e))?;
        }
        let put_back = || {
            let _ = mon.set(&rules_before, false);
            let _ = mon.set_sampling(sampling_before);
        };
        if let Err(e) = mon.set(&rules, r.reset && (sel.all || !sel.rules.is_empty())) {
            put_back();
            return Err(from_latency(&e));
        }
        if let Some(tc) = tc {
            let reset = r.reset && (sel.all || !sel.routes.is_empty());
            if let Err(e) = tc.latency().set(&routes, reset) {
                // All or nothing: the rules' switch goes back too.
                put_back();
                return Err(from_latency(&e));
            }
        }
        drop(reg);
        let sampling = sampling.unwrap_or(sampling_before);
        tracing::info!(owner = %r.owner, ?rules, ?routes, reset = r.reset, sampling = sampling.name(), "latency monitor switched");
        let routes = tc.map(|_| &routes);
        Ok(pb::SetLatencyResponse { state: Some(convert::latency_state_to_pb(&rules, routes, sampling)) })
    }

    fn get_latency(&self, r: pb::GetLatencyRequest) -> Result<pb::GetLatencyResponse, Status> {
        let reg = self.dp.registry();
        let sel = self.latency_selection(&reg, r.rules.as_ref())?;
        let mon = self.dp.latency();
        let scope = mon.scope().map_err(|e| from_latency(&e))?;
        let sampling = mon.sampling().map_err(|e| from_latency(&e))?;
        let mut histograms = Vec::new();
        if sel.all || !sel.rules.is_empty() {
            let rule = |id: u32| convert::rule_ref_to_pb(id, reg.rule_by_id(id));
            let hists = mon.histograms(&sel.rules).map_err(|e| from_latency(&e))?;
            histograms
                .extend(hists.iter().map(|h| convert::histogram_to_pb(h, rule(h.rule_id), h.from_rule.map(rule))));
        }
        let tc = self.tc.as_deref().ok();
        let route_scope = match tc {
            Some(tc) => Some(tc.latency().scope().map_err(|e| from_latency(&e))?),
            None => None,
        };
        if let Some(tc) = tc.filter(|_| sel.all || !sel.routes.is_empty()) {
            let installed = tc.routes();
            let route = |id: u32| convert::route_ref_to_pb(id, installed.iter().find(|r| r.id() == id));
            let hists = tc.latency().histograms(&sel.routes).map_err(|e| from_latency(&e))?;
            histograms.extend(hists.iter().map(|h| convert::histogram_to_pb(h, route(h.rule_id), None)));
        }
        Ok(pb::GetLatencyResponse {
            state: Some(convert::latency_state_to_pb(&scope, route_scope.as_ref(), sampling)),
            histograms,
        })
    }

    fn watch_latency(&self, r: pb::WatchLatencyRequest, caller: String) -> Result<LatencyStream, Status> {
        let every = match r.interval_ms {
            0 => 1000,
            n if n < 100 => return Err(invalid_field("interval_ms", format!("{n} is less than 100"))),
            n => n,
        };
        let req = pb::GetLatencyRequest { rules: r.rules };
        // Checked now: a bad selector fails the call, not the first message.
        self.get_latency(req.clone())?;
        let watcher = WatcherSlot::take(&self.watchers, &caller, &self.cfg)?;
        let this = self.clone();
        let ticks = tokio_stream::wrappers::IntervalStream::new(tokio::time::interval(
            std::time::Duration::from_millis(u64::from(every)),
        ));
        let stream = ticks.then(move |_| {
            let (this, req) = (this.clone(), req.clone());
            let _held = &watcher;
            async move {
                tokio::task::spawn_blocking(move || this.get_latency(req))
                    .await
                    .unwrap_or_else(|e| Err(Status::internal(format!("latency read: {e}"))))
                    .map(|r| pb::WatchLatencyResponse { state: r.state, histograms: r.histograms })
            }
        });
        Ok(Box::pin(stream))
    }

    fn list_connections(&self, r: pb::ListConnectionsRequest) -> Result<pb::ListConnectionsResponse, Status> {
        let (filter, size, after) = convert::conn_query_from_pb(&r).map_err(|v| invalid(&v))?;
        let all = self.dp.connections(&filter).map_err(|e| match e {
            // The programs running are an older build's: a state, not a fault.
            meshwarp_core::conns::ConnsError::NoProgram { .. } => Status::failed_precondition(e.to_string()),
            e => Status::internal(e.to_string()),
        })?;
        let mut rest = all.into_iter().filter(|c| after.is_none_or(|a| c.cookie > a)).peekable();
        let page: Vec<_> = rest.by_ref().take(size).collect();
        let next_page_token = match (rest.peek(), page.last()) {
            (Some(_), Some(last)) => last.cookie.to_string(),
            _ => String::new(),
        };
        let reg = self.dp.registry();
        let connections = page
            .iter()
            .map(|c| convert::connection_to_pb(c, convert::rule_ref_to_pb(c.rule_id, reg.rule_by_id(c.rule_id))))
            .collect();
        Ok(pb::ListConnectionsResponse { connections, next_page_token })
    }

    /// Each family's running build and what starting did about another one.
    fn families(&self) -> Vec<pb::FamilyPrograms> {
        let family = |name: &str, build: String, u: &meshwarp_core::Upgrade| {
            let (upgraded_from, upgrade_error) = match u {
                meshwarp_core::Upgrade::None => (String::new(), String::new()),
                meshwarp_core::Upgrade::Done { from, .. } => (from.clone(), String::new()),
                meshwarp_core::Upgrade::Failed { reason } => (String::new(), reason.clone()),
            };
            pb::FamilyPrograms { family: name.into(), programs_build: build, upgraded_from, upgrade_error }
        };
        let mut out = vec![family("socket", self.dp.programs_build().to_string(), self.dp.upgrade())];
        if let Ok(tc) = &self.tc {
            out.push(family("tc", tc.programs_build().unwrap_or_default(), tc.upgrade()));
        }
        out
    }

    fn node_info(&self, _r: pb::GetNodeInfoRequest) -> Result<pb::GetNodeInfoResponse, Status> {
        let dp = &self.dp;
        let (used, capacity) = dp.registry().usage();
        let kernel_release =
            nix::sys::utsname::uname().map(|u| u.release().to_string_lossy().into_owned()).unwrap_or_default();
        let mut features = Vec::new();
        for (name, ok, detail) in [
            ("btf", std::path::Path::new("/sys/kernel/btf/vmlinux").exists(), "/sys/kernel/btf/vmlinux"),
            ("cgroup2", !meshwarp_core::sys::mounts_of("cgroup2").is_empty(), "a cgroup2 mount"),
            ("bpffs", !meshwarp_core::sys::mounts_of("bpf").is_empty(), "a bpf filesystem"),
        ] {
            features.push(pb::KernelFeature { name: name.into(), available: ok, detail: detail.into() });
        }
        let sockops = dp.sockops_prog_id().unwrap_or(0);
        features.push(pb::KernelFeature {
            name: "sockops+sk_msg+sockmap".into(),
            available: sockops != 0,
            detail: "loaded and attached".into(),
        });
        // What the kernel does with redirected bytes (probed at start).
        for f in dp.kernel().facts() {
            features.push(pb::KernelFeature { name: f.name.into(), available: f.value, detail: f.detail.into() });
        }
        let reader_guard = pb::ReaderGuard {
            enabled: dp.guard_enabled(),
            gaps: dp.guard_gaps().into_iter().map(String::from).collect(),
            trusted_readers: dp.trusted_readers().iter().map(|p| p.display().to_string()).collect(),
            running_here: dp.guard_running_here(),
            syscall_watch: dp.syscall_watch(),
        };
        Ok(pb::GetNodeInfoResponse {
            instance_id: self.log.instance_id.clone(),
            version: self.cfg.version.clone(),
            kernel_release,
            schema_version: meshwarp_bpf::shared::SCHEMA_VERSION,
            features,
            pin_dir: dp.pin_dir().display().to_string(),
            adopted: dp.origin() == meshwarp_core::DataplaneOrigin::Adopted,
            sockops_prog_id: sockops,
            sk_msg_prog_id: dp.sk_msg_prog_id().unwrap_or(0),
            rules_used: u32::try_from(used).unwrap_or(u32::MAX),
            rules_capacity: capacity,
            max_batch_size: u32::try_from(self.cfg.max_batch_size).unwrap_or(u32::MAX),
            revision: self.log.revision(),
            reader_guard: Some(reader_guard),
            build: meshwarp_bpf::BUILD_ID.to_string(),
            programs_build: dp.programs_build().to_string(),
            families: self.families(),
        })
    }
}

/// Each RPC runs its synchronous body through `blocking` and records its
/// outcome.
macro_rules! rpc {
    ($self:ident, $name:literal, $req:ident, $body:ident) => {{
        let start = Instant::now();
        if let Err(denied) = crate::access::authorize(&$req) {
            return $self.observed($name, start, Err(denied));
        }
        let req = $req.into_inner();
        let r = $self.blocking($name, move |this| this.$body(req)).await;
        $self.observed($name, start, r)
    }};
    // The body also gets who calls (the identity the transport proved).
    ($self:ident, $name:literal, $req:ident, $body:ident, caller) => {{
        let start = Instant::now();
        if let Err(denied) = crate::access::authorize(&$req) {
            return $self.observed($name, start, Err(denied));
        }
        let caller = $req.extensions().get::<crate::access::Identity>().map(ToString::to_string).unwrap_or_default();
        let req = $req.into_inner();
        let r = $self.blocking($name, move |this| this.$body(req, caller)).await;
        $self.observed($name, start, r)
    }};
}

#[tonic::async_trait]
impl NodeService for NodeServer {
    async fn create_pair(
        &self,
        req: Request<pb::CreatePairRequest>,
    ) -> Result<Response<pb::CreatePairResponse>, Status> {
        rpc!(self, "CreatePair", req, create_pair)
    }
    async fn update_pair(
        &self,
        req: Request<pb::UpdatePairRequest>,
    ) -> Result<Response<pb::UpdatePairResponse>, Status> {
        rpc!(self, "UpdatePair", req, update_pair)
    }
    async fn delete_pair(
        &self,
        req: Request<pb::DeletePairRequest>,
    ) -> Result<Response<pb::DeletePairResponse>, Status> {
        rpc!(self, "DeletePair", req, delete_pair)
    }
    async fn get_pair(&self, req: Request<pb::GetPairRequest>) -> Result<Response<pb::GetPairResponse>, Status> {
        rpc!(self, "GetPair", req, get_pair)
    }
    async fn list_pairs(&self, req: Request<pb::ListPairsRequest>) -> Result<Response<pb::ListPairsResponse>, Status> {
        rpc!(self, "ListPairs", req, list_pairs)
    }
    async fn batch_upsert_pairs(
        &self,
        req: Request<pb::BatchUpsertPairsRequest>,
    ) -> Result<Response<pb::BatchUpsertPairsResponse>, Status> {
        rpc!(self, "BatchUpsertPairs", req, batch_upsert_pairs)
    }
    async fn batch_delete_pairs(
        &self,
        req: Request<pb::BatchDeletePairsRequest>,
    ) -> Result<Response<pb::BatchDeletePairsResponse>, Status> {
        rpc!(self, "BatchDeletePairs", req, batch_delete_pairs)
    }
    async fn create_capture_rule(
        &self,
        req: Request<pb::CreateCaptureRuleRequest>,
    ) -> Result<Response<pb::CreateCaptureRuleResponse>, Status> {
        rpc!(self, "CreateCaptureRule", req, create_capture)
    }
    async fn update_capture_rule(
        &self,
        req: Request<pb::UpdateCaptureRuleRequest>,
    ) -> Result<Response<pb::UpdateCaptureRuleResponse>, Status> {
        rpc!(self, "UpdateCaptureRule", req, update_capture)
    }
    async fn delete_capture_rule(
        &self,
        req: Request<pb::DeleteCaptureRuleRequest>,
    ) -> Result<Response<pb::DeleteCaptureRuleResponse>, Status> {
        rpc!(self, "DeleteCaptureRule", req, delete_capture)
    }
    async fn get_capture_rule(
        &self,
        req: Request<pb::GetCaptureRuleRequest>,
    ) -> Result<Response<pb::GetCaptureRuleResponse>, Status> {
        rpc!(self, "GetCaptureRule", req, get_capture)
    }
    async fn list_capture_rules(
        &self,
        req: Request<pb::ListCaptureRulesRequest>,
    ) -> Result<Response<pb::ListCaptureRulesResponse>, Status> {
        rpc!(self, "ListCaptureRules", req, list_captures)
    }
    async fn batch_upsert_capture_rules(
        &self,
        req: Request<pb::BatchUpsertCaptureRulesRequest>,
    ) -> Result<Response<pb::BatchUpsertCaptureRulesResponse>, Status> {
        rpc!(self, "BatchUpsertCaptureRules", req, batch_upsert_captures)
    }
    async fn batch_delete_capture_rules(
        &self,
        req: Request<pb::BatchDeleteCaptureRulesRequest>,
    ) -> Result<Response<pb::BatchDeleteCaptureRulesResponse>, Status> {
        rpc!(self, "BatchDeleteCaptureRules", req, batch_delete_captures)
    }
    async fn create_route(
        &self,
        req: Request<pb::CreateRouteRequest>,
    ) -> Result<Response<pb::CreateRouteResponse>, Status> {
        rpc!(self, "CreateRoute", req, create_route)
    }
    async fn update_route(
        &self,
        req: Request<pb::UpdateRouteRequest>,
    ) -> Result<Response<pb::UpdateRouteResponse>, Status> {
        rpc!(self, "UpdateRoute", req, update_route)
    }
    async fn delete_route(
        &self,
        req: Request<pb::DeleteRouteRequest>,
    ) -> Result<Response<pb::DeleteRouteResponse>, Status> {
        rpc!(self, "DeleteRoute", req, delete_route)
    }
    async fn get_route(&self, req: Request<pb::GetRouteRequest>) -> Result<Response<pb::GetRouteResponse>, Status> {
        rpc!(self, "GetRoute", req, get_route)
    }
    async fn list_routes(
        &self,
        req: Request<pb::ListRoutesRequest>,
    ) -> Result<Response<pb::ListRoutesResponse>, Status> {
        rpc!(self, "ListRoutes", req, list_routes)
    }
    async fn batch_upsert_routes(
        &self,
        req: Request<pb::BatchUpsertRoutesRequest>,
    ) -> Result<Response<pb::BatchUpsertRoutesResponse>, Status> {
        rpc!(self, "BatchUpsertRoutes", req, batch_upsert_routes)
    }
    async fn batch_delete_routes(
        &self,
        req: Request<pb::BatchDeleteRoutesRequest>,
    ) -> Result<Response<pb::BatchDeleteRoutesResponse>, Status> {
        rpc!(self, "BatchDeleteRoutes", req, batch_delete_routes)
    }
    async fn attach_interface(
        &self,
        req: Request<pb::AttachInterfaceRequest>,
    ) -> Result<Response<pb::AttachInterfaceResponse>, Status> {
        rpc!(self, "AttachInterface", req, attach_interface)
    }
    async fn detach_interface(
        &self,
        req: Request<pb::DetachInterfaceRequest>,
    ) -> Result<Response<pb::DetachInterfaceResponse>, Status> {
        rpc!(self, "DetachInterface", req, detach_interface)
    }
    async fn list_attachments(
        &self,
        req: Request<pb::ListAttachmentsRequest>,
    ) -> Result<Response<pb::ListAttachmentsResponse>, Status> {
        rpc!(self, "ListAttachments", req, list_attachments)
    }
    async fn get_stats(&self, req: Request<pb::GetStatsRequest>) -> Result<Response<pb::GetStatsResponse>, Status> {
        rpc!(self, "GetStats", req, stats)
    }

    async fn load_plugin(
        &self,
        req: Request<pb::LoadPluginRequest>,
    ) -> Result<Response<pb::LoadPluginResponse>, Status> {
        rpc!(self, "LoadPlugin", req, load_plugin)
    }
    async fn unload_plugin(
        &self,
        req: Request<pb::UnloadPluginRequest>,
    ) -> Result<Response<pb::UnloadPluginResponse>, Status> {
        rpc!(self, "UnloadPlugin", req, unload_plugin)
    }
    async fn list_plugins(
        &self,
        req: Request<pb::ListPluginsRequest>,
    ) -> Result<Response<pb::ListPluginsResponse>, Status> {
        rpc!(self, "ListPlugins", req, list_plugins)
    }
    async fn update_plugin_config(
        &self,
        req: Request<pb::UpdatePluginConfigRequest>,
    ) -> Result<Response<pb::UpdatePluginConfigResponse>, Status> {
        rpc!(self, "UpdatePluginConfig", req, update_plugin_config)
    }

    type WatchStream = WatchStream;

    async fn watch(&self, req: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        rpc!(self, "Watch", req, watch_stream, caller)
    }

    async fn get_node_info(
        &self,
        req: Request<pb::GetNodeInfoRequest>,
    ) -> Result<Response<pb::GetNodeInfoResponse>, Status> {
        rpc!(self, "GetNodeInfo", req, node_info)
    }

    async fn set_latency(
        &self,
        req: Request<pb::SetLatencyRequest>,
    ) -> Result<Response<pb::SetLatencyResponse>, Status> {
        rpc!(self, "SetLatency", req, set_latency)
    }
    async fn get_latency(
        &self,
        req: Request<pb::GetLatencyRequest>,
    ) -> Result<Response<pb::GetLatencyResponse>, Status> {
        rpc!(self, "GetLatency", req, get_latency)
    }

    type WatchLatencyStream = LatencyStream;

    async fn watch_latency(
        &self,
        req: Request<pb::WatchLatencyRequest>,
    ) -> Result<Response<Self::WatchLatencyStream>, Status> {
        rpc!(self, "WatchLatency", req, watch_latency, caller)
    }
    async fn list_connections(
        &self,
        req: Request<pb::ListConnectionsRequest>,
    ) -> Result<Response<pb::ListConnectionsResponse>, Status> {
        rpc!(self, "ListConnections", req, list_connections)
    }
    async fn sync_owner(&self, req: Request<pb::SyncOwnerRequest>) -> Result<Response<pb::SyncOwnerResponse>, Status> {
        rpc!(self, "SyncOwner", req, sync_owner)
    }
    async fn renew_lease(
        &self,
        req: Request<pb::RenewLeaseRequest>,
    ) -> Result<Response<pb::RenewLeaseResponse>, Status> {
        rpc!(self, "RenewLease", req, renew_lease)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_slots_are_limited_in_all_and_per_caller() {
        let cfg = ServerConfig { max_watchers: 3, max_watchers_per_caller: 2, ..ServerConfig::default() };
        let counts = Arc::new(Mutex::new(WatchCounts::default()));
        let a1 = WatcherSlot::take(&counts, "a", &cfg).unwrap();
        let _a2 = WatcherSlot::take(&counts, "a", &cfg).unwrap();
        let e = WatcherSlot::take(&counts, "a", &cfg).err().unwrap();
        assert!(e.message().contains("max_watchers_per_caller"), "{e:?}");
        // Another caller still gets one of the slots left...
        let _b1 = WatcherSlot::take(&counts, "b", &cfg).unwrap();
        // ...up to the node's limit.
        let e = WatcherSlot::take(&counts, "c", &cfg).err().unwrap();
        assert!(e.message().contains("limit is 3 (max_watchers)"), "{e:?}");
        drop(a1);
        let _c1 = WatcherSlot::take(&counts, "c", &cfg).unwrap();
        assert_eq!(counts.lock().unwrap().per_caller.get("a"), Some(&1));
    }
}
