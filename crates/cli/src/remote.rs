//! The gRPC client subcommands: requests to a node service and their output as
//! a table, JSON (the proto3 JSON mapping) or YAML.

use std::net::{IpAddr, SocketAddr};

use anyhow::{Context, Result};
use meshwarp_grpc_api::pb::node_service_client::NodeServiceClient;
use meshwarp_grpc_api::pb::{self, watch_response::Resource};
use serde::Serialize;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic_types::StatusExt;

use crate::{CaptureCmd, PairCmd};

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
            let mut out = format!("{:?}:", s.code());
            for v in violations {
                out.push_str(&format!("\n  {}: {}", v.field, v.description));
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

fn counters_cols(c: Option<pb::RuleCounters>) -> String {
    let c = c.unwrap_or_default();
    let fb = c.fallback_no_peer + c.fallback_tcp_path + c.fallback_map_full + c.fallback_insert_error;
    format!("{:>8} {:>12} {:>14} {:>10}", c.sockets, c.redirected_msgs, c.redirected_bytes, fb)
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

    /// Prints `msg` as JSON/YAML, or calls `table` for the table format.
    fn emit<T: Serialize>(&self, msg: &T, table: impl FnOnce()) -> Result<()> {
        match self.out {
            Output::Table => table(),
            Output::Json => println!("{}", serde_json::to_string_pretty(msg)?),
            Output::Yaml => print!("{}", serde_yaml::to_string(&serde_json::to_value(msg)?)?),
        }
        Ok(())
    }

    fn key(client: IpAddr, server: SocketAddr) -> Option<pb::PairKey> {
        Some(pb::PairKey { client_ip: client.to_string(), server: ep(server) })
    }

    pub async fn pair(&mut self, cmd: &PairCmd) -> Result<()> {
        let owner = self.owner.clone();
        let pair = |client: &IpAddr, server: &SocketAddr| {
            Some(pb::EndpointPair { client_ip: client.to_string(), server: ep(*server), owner: String::new() })
        };
        match cmd {
            PairCmd::Add { client, server } => {
                let r =
                    self.c.create_pair(pb::CreatePairRequest { pair: pair(client, server), owner }).await?.into_inner();
                self.emit(&r, || println!("created pair {client} -> {server} (revision {})", r.revision))
            }
            PairCmd::Update { client, server, allow_missing } => {
                let req = pb::UpdatePairRequest { pair: pair(client, server), owner, allow_missing: *allow_missing };
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
                    println!(
                        "{:<20} {:<24} {:<16} {:>8} {:>12} {:>14} {:>10}",
                        "CLIENT", "SERVER", "OWNER", "SOCKETS", "MSGS", "BYTES", "FALLBACKS"
                    );
                    println!(
                        "{:<20} {:<24} {:<16} {}",
                        p.client_ip,
                        show_ep(&p.server),
                        p.owner,
                        counters_cols(r.counters)
                    );
                })
            }
            PairCmd::Ls { owned_by } => {
                let r = self.c.list_pairs(pb::ListPairsRequest { owner: owned_by.clone() }).await?.into_inner();
                self.emit(&r, || {
                    println!("{:<20} {:<24} {:<16}", "CLIENT", "SERVER", "OWNER");
                    for p in &r.pairs {
                        println!("{:<20} {:<24} {:<16}", p.client_ip, show_ep(&p.server), p.owner);
                    }
                    println!("({} pairs, revision {})", r.pairs.len(), r.revision);
                })
            }
        }
    }

    pub async fn capture(&mut self, cmd: &CaptureCmd) -> Result<()> {
        let owner = self.owner.clone();
        match cmd {
            CaptureCmd::Add { dst, listener, client } => {
                let rule = pb::CaptureRule {
                    client_ip: client.map(|c| c.to_string()).unwrap_or_default(),
                    original_dst: ep(*dst),
                    listener: ep(*listener),
                    owner: String::new(),
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
                    .list_capture_rules(pb::ListCaptureRulesRequest { owner: owned_by.clone() })
                    .await?
                    .into_inner();
                self.emit(&r, || {
                    println!("{:<20} {:<24} {:<24} {:<16}", "CLIENT", "ORIGINAL DST", "LISTENER", "OWNER");
                    for c in &r.rules {
                        let client = if c.client_ip.is_empty() { "*" } else { &c.client_ip };
                        println!(
                            "{client:<20} {:<24} {:<24} {:<16}",
                            show_ep(&c.original_dst),
                            show_ep(&c.listener),
                            c.owner
                        );
                    }
                    println!("({} rules, revision {})", r.rules.len(), r.revision);
                })
            }
        }
    }

    pub async fn stats(&mut self) -> Result<()> {
        let r = self.c.get_stats(pb::GetStatsRequest {}).await?.into_inner();
        self.emit(&r, || {
            let g = r.global.unwrap_or_default();
            println!("established {}  not covered {}  no state {}", g.established, g.not_covered, g.no_state);
            println!("{:<48} {:>8} {:>12} {:>14} {:>10}", "RULE", "SOCKETS", "MSGS", "BYTES", "FALLBACKS");
            for p in &r.pairs {
                let pair = p.pair.clone().unwrap_or_default();
                let name = format!("pair {} -> {}", pair.client_ip, show_ep(&pair.server));
                println!("{name:<48} {}", counters_cols(p.counters));
            }
            for c in &r.capture_rules {
                let rule = c.rule.clone().unwrap_or_default();
                let name = format!("capture -> {} at {}", show_ep(&rule.original_dst), show_ep(&rule.listener));
                println!("{name:<48} {}", counters_cols(c.counters));
            }
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
                    None => "-".into(),
                };
                println!("{:>6} {ty:<20} {what}", ev.revision);
            })?;
        }
        Ok(())
    }

    pub async fn node_info(&mut self) -> Result<()> {
        let r = self.c.get_node_info(pb::GetNodeInfoRequest {}).await?.into_inner();
        self.emit(&r, || {
            println!("instance     {}", r.instance_id);
            println!("version      {} (pin schema v{})", r.version, r.schema_version);
            println!("kernel       {}", r.kernel_release);
            println!("data path    {} ({})", r.pin_dir, if r.adopted { "adopted" } else { "loaded" });
            println!("programs     sockops #{} sk_msg #{}", r.sockops_prog_id, r.sk_msg_prog_id);
            println!("rules        {} of {}  (batches up to {})", r.rules_used, r.rules_capacity, r.max_batch_size);
            println!("revision     {}", r.revision);
            for f in &r.features {
                println!("feature      {:<24} {}  {}", f.name, if f.available { "yes" } else { "NO " }, f.detail);
            }
        })
    }
}
