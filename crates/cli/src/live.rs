//! The observing commands against a node: `latency on|off|show|watch`
//! (SetLatency, GetLatency, WatchLatency), `conns` (ListConnections, every
//! page) and `top` (both, every interval), with their loops and Ctrl-C.
//! What they print is the library's: [`meshwarp_cli::latency`],
//! [`meshwarp_cli::svg`], [`meshwarp_cli::conns`], [`meshwarp_cli::top`].

use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use meshwarp_cli::conns::{self, ConnsFilterArgs};
use meshwarp_cli::latency::{render_report, LatencyReport, MetricArg, RuleSelectorArgs, SamplingArg, StateView};
use meshwarp_cli::top::{self, Frame, Screen, Snapshot};
use meshwarp_grpc_api::pb;
use tokio_stream::StreamExt;

use crate::remote::{Output, Remote};

/// `latency on` (`enabled`) and `latency off`; `sampling`: `None` keeps the node's.
pub async fn latency_set(
    r: &mut Remote,
    enabled: bool,
    rules: &RuleSelectorArgs,
    reset: bool,
    sampling: Option<SamplingArg>,
) -> Result<()> {
    let req = pb::SetLatencyRequest {
        owner: r.owner().to_string(),
        enabled,
        rules: Some(rules.to_pb()),
        reset,
        sampling: sampling.map_or(pb::LatencySampling::Unspecified, SamplingArg::to_pb).into(),
    };
    let resp = r.client().set_latency(req).await?.into_inner();
    r.emit(&resp, || {
        let reset = if reset { " (histograms reset)" } else { "" };
        println!("{}{reset}", StateView::from_pb(&resp.state).line());
    })
}

/// `latency show`: the histograms, and with `svg` their picture.
pub async fn latency_show(
    r: &mut Remote,
    rules: &RuleSelectorArgs,
    metrics: &[MetricArg],
    svg: Option<&Path>,
) -> Result<()> {
    let resp = r.client().get_latency(pb::GetLatencyRequest { rules: Some(rules.to_pb()) }).await?.into_inner();
    let report = LatencyReport::from_pb(&resp, metrics);
    if let Some(path) = svg {
        let picture = meshwarp_cli::svg::render(&report)?;
        std::fs::write(path, picture).with_context(|| format!("writing {}", path.display()))?;
        // Not on stdout: it may be JSON.
        eprintln!("wrote {}", path.display());
    }
    r.emit(&report, || print!("{}", render_report(&report)))
}

/// Runs `work` until it ends or Ctrl-C (then Ok).
async fn until_ctrl_c(work: impl std::future::Future<Output = Result<()>>) -> Result<()> {
    tokio::select! {
        r = work => r,
        r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C"),
    }
}

/// A frame of a live command in JSON (one line) or YAML (one document).
fn print_doc<T: serde::Serialize>(out: Output, doc: &T) -> Result<()> {
    match out {
        Output::Json => println!("{}", serde_json::to_string(doc)?),
        _ => print!("---\n{}", serde_norway::to_string(&serde_json::to_value(doc)?)?),
    }
    Ok(())
}

/// `latency watch`: the histograms every `interval_ms`, redrawn in place on
/// a terminal, until Ctrl-C or `count` updates.
pub async fn latency_watch(
    r: &mut Remote,
    rules: &RuleSelectorArgs,
    metrics: &[MetricArg],
    interval_ms: u32,
    count: Option<u64>,
) -> Result<()> {
    let out = r.output();
    let stdout = std::io::stdout();
    let tty = stdout.is_terminal();
    let mut screen = Screen::new(stdout, tty);
    let req = pb::WatchLatencyRequest { rules: Some(rules.to_pb()), interval_ms };
    let mut stream = r.client().watch_latency(req).await?.into_inner();
    let work = async {
        let mut n = 0u64;
        while let Some(resp) = stream.next().await {
            let w = resp.context("latency stream")?;
            let snapshot = pb::GetLatencyResponse { state: w.state, histograms: w.histograms };
            let report = LatencyReport::from_pb(&snapshot, metrics);
            n += 1;
            if out == Output::Table {
                let head = format!("every {interval_ms} ms (update {n}), Ctrl-C to stop; ");
                screen.show(&(head + &render_report(&report)))?;
            } else {
                print_doc(out, &report)?;
            }
            if count.is_some_and(|c| n >= c) {
                break;
            }
        }
        Ok(())
    };
    until_ctrl_c(work).await
}

/// Every connection the filter selects, following the pages.
async fn list_all(r: &mut Remote, filter: &ConnsFilterArgs) -> Result<Vec<pb::Connection>> {
    let mut all = Vec::new();
    let mut token = String::new();
    loop {
        let page = r.client().list_connections(filter.request(token.clone())).await?.into_inner();
        all.extend(page.connections);
        if page.next_page_token.is_empty() {
            return Ok(all);
        }
        // A node that hands back the same token would page forever.
        anyhow::ensure!(page.next_page_token != token, "ListConnections returned the same page token twice");
        token = page.next_page_token;
    }
}

/// `conns`: the connections, every page.
pub async fn conns(r: &mut Remote, filter: &ConnsFilterArgs) -> Result<()> {
    let connections = list_all(r, filter).await?;
    let all = pb::ListConnectionsResponse { connections, next_page_token: String::new() };
    r.emit(&all, || println!("{}", conns::render_table(&all.connections)))
}

/// `top`: connections, traffic and latency per rule every `interval_ms`,
/// redrawn in place on a terminal, until Ctrl-C or `count` refreshes.
pub async fn top(r: &mut Remote, interval_ms: u32, count: Option<u64>) -> Result<()> {
    let interval = Duration::from_millis(u64::from(interval_ms));
    let stdout = std::io::stdout();
    let tty = stdout.is_terminal();
    let mut screen = Screen::new(stdout, tty);
    let work = async {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut prev: Option<(Snapshot, Instant)> = None;
        let mut refresh = 0u64;
        loop {
            ticks.tick().await;
            let connections = list_all(r, &ConnsFilterArgs::default()).await?;
            let latency = r.client().get_latency(pb::GetLatencyRequest { rules: None }).await?.into_inner();
            let now = Instant::now();
            let snap = Snapshot::from_connections(&connections);
            let rates = prev.as_ref().map(|(p, at)| top::rates(p, &snap, now.duration_since(*at).as_secs_f64()));
            refresh += 1;
            let frame = Frame { conns: &connections, rates: rates.as_ref(), latency: &latency, interval, refresh };
            screen.show(&top::render_frame(&frame))?;
            prev = Some((snap, now));
            if count.is_some_and(|c| refresh >= c) {
                return Ok(());
            }
        }
    };
    until_ctrl_c(work).await
}
