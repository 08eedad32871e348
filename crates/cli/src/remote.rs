//! The gRPC client subcommands: requests to a node service and their output as
//! a table, JSON (the proto3 JSON mapping) or YAML.

use std::net::{IpAddr, SocketAddr};

use anyhow::{Context, Result};
use meshwarp_cli::output::{dir, iface, prefix, show_route, table};
use meshwarp_grpc_api::pb::node_service_client::NodeServiceClient;
use meshwarp_grpc_api::pb::{self, watch_response::Resource};
use serde::Serialize;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic_types::StatusExt;

use crate::{
    CaptureCmd, ConfigArg, HookArg, ModeArg, PairCmd, PhaseArg, PluginCmd, RouteAt, RouteCmd, RuleEndArg, RuleOptions,
};

fn route_key(at: &RouteAt) -> Option<pb::RouteKey> {
    Some(pb::RouteKey { attach: iface(&at.attach), direction: dir(at.egress), dst: prefix(&at.dst) })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
    Yaml,
}

/// An error as the user should read it: for a gRPC status, its code, the
/// server's message and every field violation.
pub fn describe(e: &anyhow::Error) -> String {
    for cause in e.chain() {
        if let Some(s) = cause.downcast_ref::<tonic::Status>() {
            let violations = s.get_details_bad_request().map(|b| b.field_violations).unwrap_or_default();
            if violations.is_empty() {
                return format!("{:?}: {}", s.code(), s.message());
            }
            let summary: Vec<String> = violations.iter().map(|v| format!("{}: {}", v.field, v.description)).collect();
            let mut out = format!("{:?}:", s.code());
            for v in &summary {
                out.push_str(&format!("\n  {v}"));
            }
            // A message that says more than the violations (a verifier log).
            if s.message() != summary.join("; ") {
                out.push_str(&format!("\n{}", s.message()));
            }
            return out;
        }
    }
    format!("{e:#}")
}

fn ep(a: SocketAddr) -> Option<pb::Endpoint> {
    Some(pb::Endpoint { ip: a.ip().to_string(), port: u32::from(a.port()) })
}

fn show_ep(e: &Option<pb::Endpoint>) -> String {
    match e {
        Some(e) if e.ip.contains(':') => format!("[{}]:{}", e.ip, e.port),
        Some(e) => format!("{}:{}", e.ip, e.port),
        None => "-".into(),
    }
}

fn mode_to_pb(m: ModeArg) -> i32 {
    (match m {
        ModeArg::Adaptive => pb::FastPathMode::Adaptive,
        ModeArg::Always => pb::FastPathMode::Always,
        ModeArg::Never => pb::FastPathMode::Never,
    }) as i32
}

fn show_mode(m: i32) -> &'static str {
    match pb::FastPathMode::try_from(m) {
        Ok(pb::FastPathMode::Always) => "always",
        Ok(pb::FastPathMode::Never) => "never",
        Ok(_) => "adaptive",
        Err(_) => "?",
    }
}

fn never_into(n: &RuleOptions) -> Vec<i32> {
    n.ends
        .iter()
        .map(|e| match e {
            RuleEndArg::Client => pb::RuleEnd::Client as i32,
            RuleEndArg::Server => pb::RuleEnd::Server as i32,
        })
        .collect()
}

/// The header and cells of a rule's counters, as in `counters_cols`.
const COUNTER_COLS: [&str; 4] = ["SOCKETS", "MSGS", "BYTES", "FALLBACKS"];

/// What the adaptive policy did to a rule's connections, one line.
fn policy_line(c: &pb::RuleCounters) -> String {
    let parts = [
        ("demoted (coalesce)", c.demotions_coalesce),
        ("demoted (reader behind)", c.demotions_behind),
        ("demoted (around its reader)", c.demotions_around),
        ("promoted", c.promotions),
        ("messages on TCP", c.policy_tcp_msgs),
        ("unlinked", c.unlinks),
        ("relinked", c.relinks),
        ("readers woken (FIONREAD missed TCP bytes)", c.reader_wakeups),
        ("clients whose sends skip sk_msg (server no target)", c.tgtmap_clients),
        ("stale listener hints", c.hint_stale),
        ("connections kept on TCP (mode never)", c.fallback_mode_never),
        ("connections kept on TCP (short ones)", c.fallback_short),
    ];
    parts.map(|(label, n)| format!("{label} {n}")).join("  ")
}

fn counters_cols(c: Option<pb::RuleCounters>) -> [String; 4] {
    let c = c.unwrap_or_default();
    let fb = c.fallback_no_peer
        + c.fallback_tcp_path
        + c.fallback_map_full
        + c.fallback_insert_error
        + c.fallback_collision
        + c.fallback_reader
        + c.fallback_splice
        + c.fallback_rcvlowat
        + c.fallback_ulp
        + c.fallback_reader_busy
        + c.fallback_urgent
        + c.fallback_zerocopy
        + c.fallback_peek_off;
    [c.sockets, c.redirected_msgs, c.redirected_bytes, fb].map(|v| v.to_string())
}

pub struct Remote {
    c: NodeServiceClient<Channel>,
    owner: String,
    out: Output,
}

impl Remote {
    pub async fn connect(
        addr: &str,
        tls: Option<&meshwarp_grpc_api::client::ClientTls>,
        owner: &str,
        out: Output,
    ) -> Result<Self> {
        let c = meshwarp_grpc_api::client::connect_tls(addr, tls).await?;
        Ok(Self { c, owner: owner.into(), out })
    }

    /// The node's client, for the commands that make their own calls
    /// ([`crate::live`]).
    pub fn client(&mut self) -> &mut NodeServiceClient<Channel> {
        &mut self.c
    }

    /// `--owner`.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// `--output` (`--json`: JSON).
    pub fn output(&self) -> Output {
        self.out
    }

    /// Prints `msg` as JSON/YAML, or calls `table` for the table format.
    pub fn emit<T: Serialize>(&self, msg: &T, table: impl FnOnce()) -> Result<()> {
        match self.out {
            Output::Table => table(),
            Output::Json => println!("{}", serde_json::to_string_pretty(msg)?),
            Output::Yaml => print!("{}", serde_norway::to_string(&serde_json::to_value(msg)?)?),
        }
        Ok(())
    }

    fn key(client: IpAddr, server: SocketAddr) -> Option<pb::PairKey> {
        Some(pb::PairKey { client_ip: client.to_string(), server: ep(server) })
    }

    pub async fn pair(&mut self, cmd: &PairCmd) -> Result<()> {
        let owner = self.owner.clone();
        let pair = |client: &IpAddr, server: &SocketAddr, opts: &RuleOptions| {
            Some(pb::EndpointPair {
                client_ip: client.to_string(),
                server: ep(*server),
                owner: String::new(),
                never_redirect_into: never_into(opts),
                mode: mode_to_pb(opts.mode),
            })
        };
        match cmd {
            PairCmd::Add { client, server, opts } => {
                let req = pb::CreatePairRequest { pair: pair(client, server, opts), owner };
                let r = self.c.create_pair(req).await?.into_inner();
                self.emit(&r, || println!("created pair {client} -> {server} (revision {})", r.revision))
            }
            PairCmd::Update { client, server, allow_missing, opts } => {
                let req =
                    pb::UpdatePairRequest { pair: pair(client, server, opts), owner, allow_missing: *allow_missing };
                let r = self.c.update_pair(req).await?.into_inner();
                let verb = if r.created { "created" } else { "updated" };
                self.emit(&r, || println!("{verb} pair {client} -> {server} (revision {})", r.revision))
            }
            PairCmd::Rm { client, server, allow_missing } => {
                let req =
                    pb::DeletePairRequest { key: Self::key(*client, *server), owner, allow_missing: *allow_missing };
                let r = self.c.delete_pair(req).await?.into_inner();
                let verb = if r.deleted { "deleted" } else { "absent:" };
                self.emit(&r, || println!("{verb} pair {client} -> {server} (revision {})", r.revision))
            }
            PairCmd::Get { client, server } => {
                let r = self.c.get_pair(pb::GetPairRequest { key: Self::key(*client, *server) }).await?.into_inner();
                self.emit(&r, || {
                    let p = r.pair.clone().unwrap_or_default();
                    let mut t =
                        table(&[&["CLIENT", "SERVER", "OWNER", "MODE"][..], &COUNTER_COLS].concat(), &[4, 5, 6, 7]);
                    let row = [p.client_ip.clone(), show_ep(&p.server), p.owner.clone(), show_mode(p.mode).to_string()];
                    t.add_row(row.into_iter().chain(counters_cols(r.counters)));
                    println!("{t}");
                    println!("policy: {}", policy_line(&r.counters.unwrap_or_default()));
                })
            }
            PairCmd::Ls { owned_by } => {
                let r = self
                    .c
                    .list_pairs(pb::ListPairsRequest { owner: owned_by.clone(), ..Default::default() })
                    .await?
                    .into_inner();
                self.emit(&r, || {
                    let mut t = table(&["CLIENT", "SERVER", "OWNER", "MODE"], &[]);
                    for p in &r.pairs {
                        t.add_row([
                            p.client_ip.clone(),
                            show_ep(&p.server),
                            p.owner.clone(),
                            show_mode(p.mode).to_string(),
                        ]);
                    }
                    println!("{t}");
                    println!("({} pairs, revision {})", r.pairs.len(), r.revision);
                })
            }
        }
    }

    pub async fn capture(&mut self, cmd: &CaptureCmd) -> Result<()> {
        let owner = self.owner.clone();
        match cmd {
            CaptureCmd::Add { dst, listener, client, opts } => {
                let rule = pb::CaptureRule {
                    client_ip: client.map(|c| c.to_string()).unwrap_or_default(),
                    original_dst: ep(*dst),
                    listener: ep(*listener),
                    owner: String::new(),
                    never_redirect_into: never_into(opts),
                    mode: mode_to_pb(opts.mode),
                };
                let r = self
                    .c
                    .create_capture_rule(pb::CreateCaptureRuleRequest { rule: Some(rule), owner })
                    .await?
                    .into_inner();
                self.emit(&r, || println!("created capture rule -> {dst} at {listener} (revision {})", r.revision))
            }
            CaptureCmd::Rm { dst, client, allow_missing } => {
                let key = pb::CaptureRuleKey {
                    client_ip: client.map(|c| c.to_string()).unwrap_or_default(),
                    original_dst: ep(*dst),
                };
                let req = pb::DeleteCaptureRuleRequest { key: Some(key), owner, allow_missing: *allow_missing };
                let r = self.c.delete_capture_rule(req).await?.into_inner();
                let verb = if r.deleted { "deleted" } else { "absent:" };
                self.emit(&r, || println!("{verb} capture rule -> {dst} (revision {})", r.revision))
            }
            CaptureCmd::Ls { owned_by } => {
                let r = self
                    .c
                    .list_capture_rules(pb::ListCaptureRulesRequest { owner: owned_by.clone(), ..Default::default() })
                    .await?
                    .into_inner();
                self.emit(&r, || {
                    let mut t = table(&["CLIENT", "ORIGINAL DST", "LISTENER", "OWNER", "MODE"], &[]);
                    for c in &r.rules {
                        let client = if c.client_ip.is_empty() { "*" } else { &c.client_ip };
                        t.add_row([
                            client.to_string(),
                            show_ep(&c.original_dst),
                            show_ep(&c.listener),
                            c.owner.clone(),
                            show_mode(c.mode).to_string(),
                        ]);
                    }
                    println!("{t}");
                    println!("({} rules, revision {})", r.rules.len(), r.revision);
                })
            }
        }
    }

    pub async fn route(&mut self, cmd: &RouteCmd) -> Result<()> {
        let owner = self.owner.clone();
        match cmd {
            RouteCmd::Add { at, src, redirect, redirect_peer, redirect_neigh, next_hop, smac, dmac, update } => {
                let (action, target) = match (redirect, redirect_peer, redirect_neigh) {
                    (Some(t), _, _) => (pb::RouteAction::Redirect, t),
                    (_, Some(t), _) => (pb::RouteAction::RedirectPeer, t),
                    (_, _, Some(t)) => (pb::RouteAction::RedirectNeigh, t),
                    _ => anyhow::bail!("one of --redirect, --redirect-peer or --redirect-neigh is required"),
                };
                let route = pb::InterfaceRoute {
                    attach: iface(&at.attach),
                    direction: dir(at.egress),
                    dst: prefix(&at.dst),
                    src: src.as_deref().and_then(prefix),
                    action: action as i32,
                    target: iface(target),
                    next_hop: next_hop.map(|n| n.to_string()).unwrap_or_default(),
                    rewrite: smac
                        .as_ref()
                        .zip(dmac.as_ref())
                        .map(|(s, d)| pb::MacRewrite { src: s.clone(), dst: d.clone() }),
                    ..Default::default()
                };
                if *update {
                    let req = pb::UpdateRouteRequest { route: Some(route), owner, allow_missing: true };
                    let r = self.c.update_route(req).await?.into_inner();
                    self.emit(&r, || {
                        println!("{} route (revision {})", if r.created { "created" } else { "updated" }, r.revision)
                    })
                } else {
                    let r =
                        self.c.create_route(pb::CreateRouteRequest { route: Some(route), owner }).await?.into_inner();
                    let shown = r.route.as_ref().map(show_route).unwrap_or_default();
                    self.emit(&r, || println!("created route {shown} (revision {})", r.revision))
                }
            }
            RouteCmd::Rm { at, allow_missing } => {
                let req = pb::DeleteRouteRequest { key: route_key(at), owner, allow_missing: *allow_missing };
                let r = self.c.delete_route(req).await?.into_inner();
                self.emit(&r, || {
                    println!("{} route (revision {})", if r.deleted { "deleted" } else { "absent:" }, r.revision)
                })
            }
            RouteCmd::Get { at } => {
                let r = self.c.get_route(pb::GetRouteRequest { key: route_key(at) }).await?.into_inner();
                self.emit(&r, || {
                    let c = r.counters.unwrap_or_default();
                    let shown = r.route.as_ref().map(show_route).unwrap_or_default();
                    println!("{shown}  packets {} bytes {} refused {}", c.packets, c.bytes, c.redirect_errors);
                })
            }
            RouteCmd::Ls { stale } => {
                let r = self
                    .c
                    .list_routes(pb::ListRoutesRequest { include_stale: *stale, ..Default::default() })
                    .await?
                    .into_inner();
                self.emit(&r, || {
                    let mut t = table(&["ROUTE", "OWNER", "STALE"], &[]);
                    for x in &r.routes {
                        let stale = if x.stale { x.stale_reason.clone() } else { String::new() };
                        t.add_row([show_route(x), x.owner.clone(), stale]);
                    }
                    println!("{t}");
                    println!("({} routes, revision {})", r.routes.len(), r.revision);
                })
            }
        }
    }

    pub async fn attach(&mut self, name: &str, egress: bool) -> Result<()> {
        let r = self
            .c
            .attach_interface(pb::AttachInterfaceRequest { iface: iface(name), direction: dir(egress) })
            .await?
            .into_inner();
        self.emit(&r, || println!("attached to {name} (ifindex {}, {})", r.ifindex, r.mode))
    }

    pub async fn detach(&mut self, name: &str, egress: bool, allow_missing: bool) -> Result<()> {
        let req = pb::DetachInterfaceRequest { iface: iface(name), direction: dir(egress), allow_missing };
        let r = self.c.detach_interface(req).await?.into_inner();
        self.emit(&r, || println!("{} {name}", if r.detached { "detached from" } else { "was not attached to" }))
    }

    pub async fn attachments(&mut self) -> Result<()> {
        let r = self.c.list_attachments(pb::ListAttachmentsRequest {}).await?.into_inner();
        self.emit(&r, || {
            let mut t = table(&["IFINDEX", "HOOK", "PACKETS", "MISSES"], &[0, 2, 3]);
            for a in &r.attachments {
                let d = if a.direction == pb::Direction::Egress as i32 { "egress" } else { "ingress" };
                t.add_row([a.ifindex.to_string(), d.to_string(), a.packets.to_string(), a.misses.to_string()]);
            }
            println!("{t}");
        })
    }

    pub async fn stats(&mut self) -> Result<()> {
        let r = self.c.get_stats(pb::GetStatsRequest {}).await?.into_inner();
        self.emit(&r, || {
            let g = r.global.unwrap_or_default();
            println!(
                "established {}  not covered {}  no state {}  server end without client end {}  no slot {}  \
                 stale slots {}",
                g.established, g.not_covered, g.no_state, g.no_link, g.no_slot, g.slots_stale
            );
            let mut t = table(&[&["RULE"][..], &COUNTER_COLS].concat(), &[1, 2, 3, 4]);
            for p in &r.pairs {
                let pair = p.pair.clone().unwrap_or_default();
                let name = format!("pair {} -> {}", pair.client_ip, show_ep(&pair.server));
                t.add_row(std::iter::once(name).chain(counters_cols(p.counters)));
            }
            for c in &r.capture_rules {
                let rule = c.rule.clone().unwrap_or_default();
                let name = format!("capture -> {} at {}", show_ep(&rule.original_dst), show_ep(&rule.listener));
                t.add_row(std::iter::once(name).chain(counters_cols(c.counters)));
            }
            println!("{t}");
            let rules = r.pairs.iter().map(|p| p.counters).chain(r.capture_rules.iter().map(|c| c.counters));
            let t = rules.flatten().fold(pb::RuleCounters::default(), |mut a, c| {
                a.fallback_no_peer += c.fallback_no_peer;
                a.fallback_tcp_path += c.fallback_tcp_path;
                a.fallback_map_full += c.fallback_map_full;
                a.fallback_insert_error += c.fallback_insert_error;
                a.fallback_collision += c.fallback_collision;
                a.fallback_reader += c.fallback_reader;
                a.fallback_splice += c.fallback_splice;
                a.fallback_rcvlowat += c.fallback_rcvlowat;
                a.fallback_ulp += c.fallback_ulp;
                a.ulp_refused += c.ulp_refused;
                a.splice_hits += c.splice_hits;
                a.demotions_coalesce += c.demotions_coalesce;
                a.promotions += c.promotions;
                a.policy_tcp_msgs += c.policy_tcp_msgs;
                a.fallback_mode_never += c.fallback_mode_never;
                a.unlinks += c.unlinks;
                a.relinks += c.relinks;
                a.demotions_behind += c.demotions_behind;
                a.fallback_reader_busy += c.fallback_reader_busy;
                a.reader_wakeups += c.reader_wakeups;
                a.tgtmap_clients += c.tgtmap_clients;
                a.hint_stale += c.hint_stale;
                a.fallback_urgent += c.fallback_urgent;
                a.urgent_hits += c.urgent_hits;
                a.fallback_zerocopy += c.fallback_zerocopy;
                a.zerocopy_refused += c.zerocopy_refused;
                a.fallback_peek_off += c.fallback_peek_off;
                a.peek_off_refused += c.peek_off_refused;
                a.fallback_short += c.fallback_short;
                a.demotions_around += c.demotions_around;
                a
            });
            println!(
                "fallbacks: no peer {}  tcp path {}  map full {}  insert error {}  collision {}  reader {}  splice {}  \
                 rcvlowat {}  ulp {} (refused {})  reader busy {}  urgent data {}  zerocopy {} (refused {})  peek offset {} (refused {})  splice hits {}  urgent hits {}",
                t.fallback_no_peer,
                t.fallback_tcp_path,
                t.fallback_map_full,
                t.fallback_insert_error,
                t.fallback_collision,
                t.fallback_reader,
                t.fallback_splice,
                t.fallback_rcvlowat,
                t.fallback_ulp,
                t.ulp_refused,
                t.fallback_reader_busy,
                t.fallback_urgent,
                t.fallback_zerocopy,
                t.zerocopy_refused,
                t.fallback_peek_off,
                t.peek_off_refused,
                t.splice_hits,
                t.urgent_hits
            );
            println!("adaptive policy: {}", policy_line(&t));
        })
    }

    pub async fn watch(&mut self, after: u64, instance: &str) -> Result<()> {
        let req = pb::WatchRequest { after_revision: after, instance_id: instance.into() };
        let mut s = self.c.watch(req).await?.into_inner();
        while let Some(ev) = s.next().await {
            let ev = ev.context("watch stream")?;
            self.emit(&ev, || {
                let ty = pb::EventType::try_from(ev.r#type).map(|t| t.as_str_name()).unwrap_or("?");
                let what = match &ev.resource {
                    Some(Resource::Pair(p)) => format!("pair {} -> {} ({})", p.client_ip, show_ep(&p.server), p.owner),
                    Some(Resource::CaptureRule(c)) => {
                        format!("capture -> {} at {} ({})", show_ep(&c.original_dst), show_ep(&c.listener), c.owner)
                    }
                    Some(Resource::Route(r)) => format!("route {} {}", show_route(r), r.stale_reason),
                    Some(Resource::Plugin(p)) => {
                        let m = p.manifest.clone().unwrap_or_default();
                        format!("plugin {} {} at {} (#{})", m.name, m.version, hook_name(m.hook), p.position)
                    }
                    Some(Resource::Incident(i)) => {
                        let kind = pb::IncidentKind::try_from(i.kind).map(|k| k.as_str_name()).unwrap_or("?");
                        format!(
                            "{kind} {} -> {} by {} (pid {}, {}): {} B unseen, {}",
                            show_ep(&i.client),
                            show_ep(&i.server),
                            i.comm,
                            i.tgid,
                            i.exe,
                            i.pending_bytes,
                            i.detail
                        )
                    }
                    None => "-".into(),
                };
                println!("{:>6} {ty:<20} {what}", ev.revision);
            })?;
        }
        Ok(())
    }

    pub async fn plugin(&mut self, cmd: &PluginCmd) -> Result<()> {
        match cmd {
            PluginCmd::Load { object, name, hook, version, phase, priority, fail_closed, sha256, replace, config } => {
                let bytes = std::fs::read(object).with_context(|| format!("reading {}", object.display()))?;
                let manifest = pb::PluginManifest {
                    name: name.clone(),
                    version: version.clone(),
                    hook: match hook {
                        HookArg::Connection => pb::PluginHook::Connection,
                        HookArg::Message => pb::PluginHook::Message,
                        HookArg::Packet => pb::PluginHook::Packet,
                    } as i32,
                    phase: match phase {
                        None => pb::PluginPhase::Unspecified,
                        Some(PhaseArg::Authn) => pb::PluginPhase::Authn,
                        Some(PhaseArg::Authz) => pb::PluginPhase::Authz,
                        Some(PhaseArg::Stats) => pb::PluginPhase::Stats,
                    } as i32,
                    priority: *priority,
                    failure_policy: if *fail_closed {
                        pb::FailurePolicy::FailClosed
                    } else {
                        pb::FailurePolicy::FailOpen
                    } as i32,
                    sha256: sha256.clone().unwrap_or_default(),
                };
                let req = pb::LoadPluginRequest {
                    manifest: Some(manifest),
                    object: bytes,
                    config: config_bytes(config)?,
                    replace: *replace,
                    owner: self.owner.clone(),
                };
                let r = self.c.load_plugin(req).await?.into_inner();
                let p = r.plugin.clone().unwrap_or_default();
                self.emit(&r, || {
                    let verb = if r.replaced { "replaced" } else { "loaded" };
                    println!("{verb} plugin {name} (id {}, prog #{}, position {})", p.id, p.prog_id, p.position)
                })
            }
            PluginCmd::Unload { name, allow_missing } => {
                let req = pb::UnloadPluginRequest {
                    name: name.clone(),
                    allow_missing: *allow_missing,
                    owner: self.owner.clone(),
                };
                let r = self.c.unload_plugin(req).await?.into_inner();
                self.emit(&r, || println!("{} {name}", if r.unloaded { "unloaded" } else { "not loaded:" }))
            }
            PluginCmd::Ls => {
                let r = self.c.list_plugins(pb::ListPluginsRequest {}).await?.into_inner();
                self.emit(&r, || {
                    let mut t = table(
                        &["HOOK", "NAME", "POS", "PHASE", "PRIO", "PROG", "RUNS", "CONTINUE", "VERDICT1", "DROP"],
                        &[2, 4, 5, 6, 7, 8, 9],
                    );
                    for p in &r.plugins {
                        let m = p.manifest.clone().unwrap_or_default();
                        let c = p.counters.unwrap_or_default();
                        let phase = pb::PluginPhase::try_from(m.phase)
                            .map(|x| x.as_str_name().trim_start_matches("PLUGIN_PHASE_").to_lowercase())
                            .unwrap_or_default();
                        t.add_row([
                            hook_name(m.hook).to_string(),
                            m.name,
                            p.position.to_string(),
                            phase,
                            m.priority.to_string(),
                            p.prog_id.to_string(),
                            c.runs.to_string(),
                            c.continued.to_string(),
                            (c.declined + c.bypassed + c.passed).to_string(),
                            c.dropped.to_string(),
                        ]);
                    }
                    println!("{t}");
                })
            }
            PluginCmd::Examples { .. } => anyhow::bail!("`plugin examples` runs locally, not against a node"),
            PluginCmd::Config { name, config } => {
                let req = pb::UpdatePluginConfigRequest {
                    name: name.clone(),
                    config: config_bytes(config)?,
                    owner: self.owner.clone(),
                };
                let r = self.c.update_plugin_config(req).await?.into_inner();
                self.emit(&r, || println!("updated config of {name}"))
            }
        }
    }

    pub async fn node_info(&mut self) -> Result<()> {
        let r = self.c.get_node_info(pb::GetNodeInfoRequest {}).await?.into_inner();
        self.emit(&r, || {
            println!("instance     {}", r.instance_id);
            println!("version      {} (pin schema v{})", r.version, r.schema_version);
            let running = if r.programs_build == r.build { "(these)".to_string() } else { r.programs_build.clone() };
            println!("build        {} (programs running: {running})", r.build);
            for f in &r.families {
                if !f.upgraded_from.is_empty() {
                    println!("upgraded     {} programs of build {} replaced in place", f.family, f.upgraded_from);
                }
                if !f.upgrade_error.is_empty() {
                    println!(
                        "upgrade      {} programs of build {} keep running: {}",
                        f.family, f.programs_build, f.upgrade_error
                    );
                }
            }
            println!("kernel       {}", r.kernel_release);
            println!("data path    {} ({})", r.pin_dir, if r.adopted { "adopted" } else { "loaded" });
            println!("programs     sockops #{} sk_msg #{}", r.sockops_prog_id, r.sk_msg_prog_id);
            println!("rules        {} of {}  (batches up to {})", r.rules_used, r.rules_capacity, r.max_batch_size);
            println!("revision     {}", r.revision);
            for f in &r.features {
                println!("feature      {:<32} {}  {}", f.name, if f.available { "yes" } else { "no " }, f.detail);
            }
            let g = r.reader_guard.clone().unwrap_or_default();
            if g.enabled {
                println!(
                    "reader guard on ({}), working around: {}; syscall watch {}",
                    if g.running_here { "this daemon" } else { "another process" },
                    g.gaps.join(", "),
                    if g.syscall_watch { "on" } else { "off" }
                );
            } else {
                println!("reader guard off");
            }
            for t in &g.trusted_readers {
                println!("trusted      {t}");
            }
        })
    }
}

fn hook_name(h: i32) -> &'static str {
    match pb::PluginHook::try_from(h) {
        Ok(pb::PluginHook::Connection) => "on_connection",
        Ok(pb::PluginHook::Message) => "on_message",
        Ok(pb::PluginHook::Packet) => "on_packet",
        _ => "?",
    }
}

/// The config bytes a command line gives.
fn config_bytes(c: &ConfigArg) -> Result<Vec<u8>> {
    if let Some(path) = &c.config_file {
        return std::fs::read(path).with_context(|| format!("reading {}", path.display()));
    }
    if let Some(h) = &c.config_hex {
        let h = h.trim();
        anyhow::ensure!(h.len() % 2 == 0, "--config-hex: odd number of digits");
        return (0..h.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&h[i..i + 2], 16).with_context(|| format!("--config-hex: bad digits at {i}")))
            .collect();
    }
    let mut out = Vec::new();
    for field in c.config_le.as_deref().unwrap_or("").split_whitespace() {
        let (ty, v) = field.split_once(':').with_context(|| format!("--config-le: {field:?} is not TYPE:VALUE"))?;
        let bad = || format!("--config-le: {field:?} does not fit {ty}");
        match ty {
            "u8" => out.extend(v.parse::<u8>().with_context(bad)?.to_le_bytes()),
            "u16" => out.extend(v.parse::<u16>().with_context(bad)?.to_le_bytes()),
            "u32" => out.extend(v.parse::<u32>().with_context(bad)?.to_le_bytes()),
            "u64" => out.extend(v.parse::<u64>().with_context(bad)?.to_le_bytes()),
            _ => anyhow::bail!("--config-le: unknown type {ty} (u8, u16, u32, u64)"),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    /// Columns stay aligned whatever the width of a cell: an IPv6 endpoint
    /// widens its column, the next column starts at the same place in every
    /// row.
    #[test]
    fn tables_align_long_ipv6_endpoints() {
        let mut t = table(&["CLIENT", "SERVER", "OWNER", "MSGS"], &[3]);
        t.add_row(["10.0.0.1", "10.0.0.2:80", "a", "1"]);
        t.add_row(["2001:db8:ffff:ffff:ffff:ffff:ffff:1", "[2001:db8:ffff:ffff:ffff:ffff:ffff:2]:65535", "b", "12345"]);
        let text = t.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        let owner_at: Vec<usize> =
            lines.iter().zip([" OWNER ", " a ", " b "]).map(|(l, cell)| l.find(cell).unwrap()).collect();
        assert!(owner_at.iter().all(|&c| c == owner_at[0]), "{text}");
        let ends: Vec<usize> = lines.iter().map(|l| l.trim_end().len()).collect();
        assert!(ends.iter().all(|&e| e == ends[0]), "numbers aligned right:\n{text}");
    }

    use super::*;

    #[test]
    fn config_sources() {
        let none = ConfigArg { config_file: None, config_hex: None, config_le: None };
        assert!(config_bytes(&none).unwrap().is_empty());
        let hex = ConfigArg { config_hex: Some("901F".into()), ..none };
        assert_eq!(config_bytes(&hex).unwrap(), [0x90, 0x1f]);
        let le = ConfigArg { config_hex: None, config_le: Some("u16:8080 u32:1 u8:7".into()), config_file: None };
        assert_eq!(config_bytes(&le).unwrap(), [0x90, 0x1f, 1, 0, 0, 0, 7]);
        for bad in ["u16:70000", "x:1", "u8"] {
            let c = ConfigArg { config_le: Some(bad.into()), config_hex: None, config_file: None };
            assert!(config_bytes(&c).is_err(), "{bad}");
        }
        let odd = ConfigArg { config_hex: Some("abc".into()), config_le: None, config_file: None };
        assert!(config_bytes(&odd).is_err());
    }
}
