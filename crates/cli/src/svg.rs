//! `meshwarp latency show --svg`: a [`LatencyReport`] drawn as an SVG
//! picture with plotters. One panel per non-empty histogram (x: the log2
//! buckets labelled in human units, y: samples), and, when the report has
//! proxy hops, a per-hop breakdown (MeshInsight-style): the mean of each
//! rule's fast/TCP delivery, each proxy hop and think time, and the
//! end-to-end response time, as horizontal bars along the request's path.
//!
//! No font is needed at build or run time: without plotters' `ttf` and
//! `ab_glyph` features text is laid out with a size estimate and the SVG
//! backend writes `<text>` elements that the viewer renders.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::latency::{HistogramView, LatencyReport, MetricArg};
use crate::output::human_ns;

/// Width of the picture, in pixels.
const WIDTH: u32 = 960;
/// Height of one histogram panel.
const PANEL: u32 = 320;
/// Height of one bar of the breakdown, and of its title and axis.
const BAR_ROW: u32 = 34;
const BREAKDOWN_EXTRA: u32 = 100;

const FONT: &str = "sans-serif";

fn color(m: MetricArg) -> RGBColor {
    match m {
        MetricArg::Fast => RGBColor(46, 139, 87),
        MetricArg::Tcp => RGBColor(230, 126, 34),
        MetricArg::Setup => RGBColor(127, 140, 141),
        MetricArg::Response => RGBColor(52, 73, 94),
        MetricArg::Think => RGBColor(142, 68, 173),
        MetricArg::Hop => RGBColor(41, 128, 185),
        MetricArg::Transit => RGBColor(192, 57, 43),
    }
}

/// One bar of the per-hop breakdown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakdownBar {
    pub label: String,
    pub metric: MetricArg,
    pub mean_ns: u64,
    pub p50_ns: u64,
}

/// The rules in the order a request crosses them: along the proxy hops
/// (`from_rule -> rule`), lowest id first among the rules whose
/// predecessors are all placed (a cycle is broken at its lowest id).
fn path_order(report: &LatencyReport) -> Vec<u32> {
    let rules: BTreeSet<u32> = report.histograms.iter().map(|h| h.rule_id).collect();
    let mut preds: BTreeMap<u32, BTreeSet<u32>> = rules.iter().map(|&r| (r, BTreeSet::new())).collect();
    for h in &report.histograms {
        if let (MetricArg::Hop, Some(from)) = (h.metric, h.from_rule_id) {
            if from != h.rule_id && rules.contains(&from) {
                preds.entry(h.rule_id).or_default().insert(from);
            }
        }
    }
    let mut order = Vec::with_capacity(rules.len());
    while order.len() < rules.len() {
        let placed = |r: &u32| order.contains(r);
        let ready = rules
            .iter()
            .find(|r| !placed(r) && preds.get(r).is_none_or(|p| p.iter().all(placed)))
            .or_else(|| rules.iter().find(|r| !placed(r)));
        match ready {
            Some(&r) => order.push(r),
            None => break,
        }
    }
    order
}

/// The breakdown's bars (empty when the report has no proxy hop): for each
/// rule along the path its fast/TCP delivery and think time, then the hops
/// that leave it; the response times last. Only histograms with samples.
pub fn breakdown(report: &LatencyReport) -> Vec<BreakdownBar> {
    let with_samples: Vec<&HistogramView> = report.histograms.iter().filter(|h| h.count > 0).collect();
    if !with_samples.iter().any(|h| h.metric == MetricArg::Hop) {
        return Vec::new();
    }
    let bar = |h: &HistogramView, label: String| BreakdownBar {
        label,
        metric: h.metric,
        mean_ns: h.mean_ns.unwrap_or(0),
        p50_ns: h.p50_ns,
    };
    let mut bars = Vec::new();
    for rule in path_order(report) {
        for m in [MetricArg::Fast, MetricArg::Tcp, MetricArg::Think] {
            for h in with_samples.iter().filter(|h| h.rule_id == rule && h.metric == m) {
                bars.push(bar(h, format!("rule {rule} {}", m.label())));
            }
        }
        for h in with_samples.iter().filter(|h| h.metric == MetricArg::Hop && h.from_rule_id == Some(rule)) {
            bars.push(bar(h, format!("proxy hop rule {rule} -> rule {}", h.rule_id)));
        }
    }
    for h in with_samples.iter().filter(|h| h.metric == MetricArg::Response) {
        bars.push(bar(h, format!("rule {} response (end to end)", h.rule_id)));
    }
    bars
}

/// The report as an SVG document.
pub fn render(report: &LatencyReport) -> Result<String> {
    let panels: Vec<&HistogramView> = report.histograms.iter().filter(|h| h.count > 0).collect();
    let bars = breakdown(report);
    let breakdown_height = if bars.is_empty() { 0 } else { BREAKDOWN_EXTRA + BAR_ROW * bars.len() as u32 };
    let height = if panels.is_empty() { 120 } else { PANEL * panels.len() as u32 + breakdown_height };
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE)?;
        if panels.is_empty() {
            let msg = format!("no latency samples ({})", report.state.line());
            root.draw(&Text::new(msg, (20, 50), (FONT, 20).into_font()))?;
        } else {
            let mut rest = root.clone();
            if !bars.is_empty() {
                let (top, below) = rest.split_vertically(breakdown_height);
                draw_breakdown(&top, &bars)?;
                rest = below;
            }
            for h in panels {
                let (top, below) = rest.split_vertically(PANEL);
                draw_histogram(&top, h)?;
                rest = below;
            }
        }
        root.present()?;
    }
    Ok(buf)
}

/// The x label of bucket edge `x`: the lower bound of bucket `x`
/// (`[2^x, 2^(x+1))`, the first from 0), `∞` at `open_end` (after the last
/// bucket, which takes everything above).
fn edge_label(x: u32, open_end: Option<u32>) -> String {
    if Some(x) == open_end || x >= 64 {
        "∞".into()
    } else if x == 0 {
        "0ns".into()
    } else {
        human_ns(1u64 << x)
    }
}

fn draw_histogram(area: &DrawingArea<SVGBackend<'_>, Shift>, h: &HistogramView) -> Result<()> {
    // The index of the first bucket shown: buckets are [2^i, 2^(i+1)).
    let first = h.buckets.first().map(|b| if b.lower_ns == 0 { 0 } else { b.lower_ns.trailing_zeros() }).unwrap_or(0);
    let end = first + h.buckets.len().max(1) as u32;
    let open_end = h.buckets.last().filter(|b| b.upper_ns.is_none()).map(|_| end);
    // An empty bucket of margin on each side, for context (none after an
    // open last bucket).
    let (lo, hi) = (first.saturating_sub(1), if open_end.is_some() { end } else { end + 1 });
    let ymax = h.buckets.iter().map(|b| b.count).max().unwrap_or(0).max(1);
    // The rule and metric on one line, the numbers on the next.
    let area = area.titled(&h.title(), (FONT, 15))?;
    let mut chart = ChartBuilder::on(&area)
        .caption(h.summary(), (FONT, 12))
        .margin(12)
        .margin_right(36)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(lo..hi, 0u64..ymax + ymax / 10 + 1)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels((hi - lo + 1).min(16) as usize)
        .x_label_formatter(&|x| edge_label(*x, open_end))
        .x_desc("latency (log2 buckets)")
        .y_desc("samples")
        .label_style((FONT, 12))
        .draw()?;
    let style = color(h.metric).filled();
    chart.draw_series(h.buckets.iter().enumerate().filter(|(_, b)| b.count > 0).map(|(i, b)| {
        let x = first + i as u32;
        let mut r = Rectangle::new([(x, 0), (x + 1, b.count)], style);
        r.set_margin(0, 0, 2, 2);
        r
    }))?;
    Ok(())
}

fn draw_breakdown(area: &DrawingArea<SVGBackend<'_>, Shift>, bars: &[BreakdownBar]) -> Result<()> {
    // Rows from the bottom: the first bar (where the request starts) on top.
    let n = bars.len() as u32;
    let row = |i: usize| n.saturating_sub(1 + i as u32);
    let xmax = bars.iter().map(|b| b.mean_ns).max().unwrap_or(0).max(1);
    // Room on the right for the value written after the longest bar.
    let xend = xmax + xmax / 3 + 1;
    let mut chart = ChartBuilder::on(area)
        .caption("per-hop breakdown (mean latency along the request's path)", (FONT, 16))
        .margin(12)
        .margin_right(36)
        .x_label_area_size(36)
        .y_label_area_size(300)
        .build_cartesian_2d(0u64..xend, (0u32..n.saturating_sub(1)).into_segmented())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n as usize + 1)
        .y_label_formatter(&|y| match y {
            SegmentValue::CenterOf(y) if *y < n => {
                bars.get(row(*y as usize) as usize).map(|b| b.label.clone()).unwrap_or_default()
            }
            _ => String::new(),
        })
        .x_label_formatter(&|x| human_ns(*x))
        .x_labels(8)
        .label_style((FONT, 12))
        .draw()?;
    chart.draw_series(bars.iter().enumerate().map(|(i, b)| {
        let y = row(i);
        let mut r = Rectangle::new(
            [(0, SegmentValue::Exact(y)), (b.mean_ns, SegmentValue::Exact(y + 1))],
            color(b.metric).filled(),
        );
        r.set_margin(5, 5, 0, 0);
        r
    }))?;
    let value_style = TextStyle::from((FONT, 12).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    chart.draw_series(bars.iter().enumerate().map(|(i, b)| {
        Text::new(
            format!(" {} (p50 {})", human_ns(b.mean_ns), human_ns(b.p50_ns)),
            (b.mean_ns, SegmentValue::CenterOf(row(i))),
            value_style.clone(),
        )
    }))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::latency::tests::{hist, pair_ref};
    use meshwarp_grpc_api::pb;

    /// A sidecar chain: rule 1 (client -> its proxy), a hop through the
    /// proxy, rule 2 (proxy -> server) where the server thinks.
    fn chain() -> LatencyReport {
        let r1 = pair_ref(1, "10.0.0.1", "10.0.0.9", 15001);
        let r2 = pair_ref(2, "10.0.0.9", "10.0.0.2", 80);
        let resp = pb::GetLatencyResponse {
            state: Some(pb::LatencyState { enabled: true, all_rules: true, ..Default::default() }),
            histograms: vec![
                hist(r2.clone(), pb::LatencyMetric::Fast, None, &[(13, 30)]),
                hist(r2.clone(), pb::LatencyMetric::Think, None, &[(21, 10)]),
                hist(r2.clone(), pb::LatencyMetric::Hop, Some(r1.clone()), &[(16, 10), (17, 5)]),
                hist(r1.clone(), pb::LatencyMetric::Fast, None, &[(12, 25), (14, 5)]),
                hist(r1.clone(), pb::LatencyMetric::Tcp, None, &[]),
                hist(r1, pb::LatencyMetric::Response, None, &[(22, 10)]),
            ],
        };
        LatencyReport::from_pb(&resp, &[])
    }

    #[test]
    fn breakdown_follows_the_request_path() {
        let labels: Vec<String> = breakdown(&chain()).into_iter().map(|b| b.label).collect();
        assert_eq!(
            labels,
            [
                "rule 1 fast-path delivery",
                "proxy hop rule 1 -> rule 2",
                "rule 2 fast-path delivery",
                "rule 2 think (read to next send)",
                "rule 1 response (end to end)",
            ]
        );
        // No hop, no breakdown.
        let mut no_hop = chain();
        no_hop.histograms.retain(|h| h.metric != MetricArg::Hop);
        assert!(breakdown(&no_hop).is_empty());
    }

    #[test]
    fn svg_has_titles_bars_and_axis_labels() {
        let svg = render(&chain()).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{svg}");
        // Titles of the panels and of the breakdown, as text.
        assert!(svg.contains("rule 1 (pair 10.0.0.1 -&gt; 10.0.0.9:15001)  fast-path delivery"), "{svg}");
        assert!(svg.contains("proxy hop from rule 1"), "{svg}");
        assert!(svg.contains("per-hop breakdown"), "{svg}");
        assert!(svg.contains("proxy hop rule 1 -&gt; rule 2"), "{svg}");
        // Bucket edges labelled in human units: bucket 12 starts at 4.1µs.
        assert!(svg.contains("\n4.1µs\n"), "{svg}");
        // Bars, by colour: fast delivery has 3 non-empty buckets in its two
        // panels and 2 bars in the breakdown; the hop 2 buckets and 1 bar.
        let bars = |fill: &str| {
            svg.match_indices("<rect").filter(|(i, _)| svg[*i..].split('>').next().unwrap().contains(fill)).count()
        };
        assert_eq!(bars("fill=\"#2E8B57\""), 5, "{svg}");
        assert_eq!(bars("fill=\"#2980B9\""), 3, "{svg}");
        assert!(svg.contains("<text"), "{svg}");
        // The empty TCP histogram has no panel.
        assert!(!svg.contains("TCP delivery"), "{svg}");
    }

    #[test]
    fn svg_of_nothing_says_so() {
        let svg = render(&LatencyReport::default()).unwrap();
        assert!(svg.contains("no latency samples (latency monitor off)"), "{svg}");
    }
}
