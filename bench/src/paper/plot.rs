//! `bench plot DIR`: draws one PNG per figure from the CSVs `bench paper` wrote into DIR, with
//! the paper's axes, units and legends. Separate from the measuring so the plots can be redrawn
//! from committed CSVs, and drawn on the host for runs made in the VM.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

/// A font for the labels: DejaVu Sans from Debian's fonts-dejavu-core (scripts/setup.sh).
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;
type Series = Vec<(String, Vec<(f64, f64)>)>;

/// Rows of a CSV file as maps from column name to text.
fn read_csv(path: &Path) -> Option<Vec<BTreeMap<String, String>>> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut lines = text.lines();
    let header: Vec<String> = lines.next()?.split(',').map(String::from).collect();
    Some(
        lines
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                header
                    .iter()
                    .cloned()
                    .zip(l.split(',').map(String::from))
                    .collect()
            })
            .collect(),
    )
}

fn num(row: &BTreeMap<String, String>, col: &str) -> f64 {
    row.get(col)
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

fn color(name: &str) -> RGBColor {
    match name {
        "status-byte" => RGBColor(31, 119, 180),
        "sliding-window" => RGBColor(214, 39, 40),
        _ => RGBColor(120, 120, 120),
    }
}

/// Series by mechanism from `rows` (filtered by `keep`), x and y from the named columns.
fn series(
    rows: &[BTreeMap<String, String>],
    keep: impl Fn(&BTreeMap<String, String>) -> bool,
    x: impl Fn(&BTreeMap<String, String>) -> f64,
    y: impl Fn(&BTreeMap<String, String>) -> f64,
) -> Series {
    let mut by: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in rows.iter().filter(|r| keep(r)) {
        let (x, y) = (x(r), y(r));
        if x.is_finite() && y.is_finite() {
            by.entry(r["mechanism"].clone()).or_default().push((x, y));
        }
    }
    // Status byte first, as in the paper's legends.
    let mut v: Series = by.into_iter().collect();
    v.sort_by_key(|(m, _)| m != "status-byte");
    v
}

fn human_bytes(b: f64) -> String {
    let b = b.round() as u64;
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{}K", b >> 10)
    } else {
        format!("{b}")
    }
}

/// How an axis maps values: linear, or log (values drawn as their logarithm, labelled with the
/// value).
#[derive(Clone, Copy, PartialEq)]
enum Scale {
    Linear,
    Log2Bytes,
    Log10,
}

impl Scale {
    fn map(self, v: f64) -> f64 {
        match self {
            Scale::Linear => v,
            Scale::Log2Bytes => v.max(1.0).log2(),
            Scale::Log10 => v.max(1e-3).log10(),
        }
    }
    fn label(self, v: f64) -> String {
        match self {
            Scale::Linear => {
                if v.abs() >= 100.0 || v == v.round() {
                    format!("{v:.0}")
                } else {
                    format!("{v:.1}")
                }
            }
            Scale::Log2Bytes => human_bytes(2f64.powf(v)),
            Scale::Log10 => {
                let x = 10f64.powf(v);
                if x >= 1.0 {
                    format!("{x:.0}")
                } else {
                    format!("{x:.2}")
                }
            }
        }
    }
}

struct Chart<'t> {
    title: &'t str,
    x_desc: &'t str,
    y_desc: &'t str,
    x: Scale,
    y: Scale,
    /// Points only (a scatter), no lines.
    points: bool,
}

fn draw(area: &Area<'_>, c: &Chart<'_>, data: &Series) -> Result<(), Box<dyn std::error::Error>> {
    let mapped: Series = data
        .iter()
        .map(|(n, pts)| {
            (
                n.clone(),
                pts.iter()
                    .map(|(x, y)| (c.x.map(*x), c.y.map(*y)))
                    .collect(),
            )
        })
        .collect();
    let all = mapped.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in all {
        x0 = x0.min(*x);
        x1 = x1.max(*x);
        y0 = y0.min(*y);
        y1 = y1.max(*y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if c.y == Scale::Linear {
        y0 = y0.min(0.0);
    }
    let pad = ((y1 - y0) * 0.08).max(1e-6);
    let xpad = ((x1 - x0) * 0.02).max(1e-6);
    let mut chart = ChartBuilder::on(area)
        .caption(c.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d((x0 - xpad)..(x1 + xpad), y0..(y1 + pad))?;
    let (xs, ys) = (c.x, c.y);
    chart
        .configure_mesh()
        .x_desc(c.x_desc)
        .y_desc(c.y_desc)
        .x_label_formatter(&|v| xs.label(*v))
        .y_label_formatter(&|v| ys.label(*v))
        .label_style(("sans-serif", 13))
        .draw()?;
    for (name, pts) in &mapped {
        let col = color(name);
        if c.points {
            chart
                .draw_series(pts.iter().map(|p| Circle::new(*p, 2, col.filled())))?
                .label(name.as_str())
                .legend(move |(x, y)| Circle::new((x + 10, y), 4, col.filled()));
        } else {
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), col.stroke_width(2)))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2))
                });
            // Markers only where they are few enough to read (not on 1 ms time series).
            if pts.len() <= 40 {
                chart.draw_series(pts.iter().map(|p| Circle::new(*p, 3, col.filled())))?;
            }
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// Grouped bars: for each category (x label), one bar per mechanism.
fn bars(
    area: &Area<'_>,
    title: &str,
    y_desc: &str,
    categories: &[&str],
    values: &BTreeMap<String, Vec<f64>>,
) -> Result<(), Box<dyn std::error::Error>> {
    let ymax = values.values().flatten().fold(1.0f64, |a, b| a.max(*b)) * 1.2;
    let n = categories.len();
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..n as f64, 0f64..ymax)?;
    let cats: Vec<String> = categories.iter().map(|s| s.to_string()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|v| {
            let k = (*v - 0.5).round();
            if (*v - 0.5 - k).abs() < 0.01 && k >= 0.0 {
                cats.get(k as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc(y_desc)
        .label_style(("sans-serif", 13))
        .draw()?;
    let m = values.len().max(1) as f64;
    let width = 0.8 / m;
    let mut ordered: Vec<(&String, &Vec<f64>)> = values.iter().collect();
    ordered.sort_by_key(|(name, _)| *name != "status-byte");
    for (k, (name, vals)) in ordered.into_iter().enumerate() {
        let col = color(name);
        chart
            .draw_series(vals.iter().enumerate().map(|(i, v)| {
                let x = i as f64 + 0.1 + k as f64 * width;
                Rectangle::new([(x, 0.0), (x + width * 0.9, *v)], col.filled())
            }))?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], col.filled()));
        chart.draw_series(vals.iter().enumerate().map(|(i, v)| {
            let x = i as f64 + 0.1 + k as f64 * width;
            let label = if v.fract().abs() < 1e-9 {
                format!("{v:.0}")
            } else {
                format!("{v:.2}")
            };
            Text::new(label, (x, *v + ymax * 0.02), ("sans-serif", 12))
        }))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// The throughput ceiling (Fig. 13's perftest or plain-TCP rate) at the block size nearest
/// `size`, as a flat line from `x0` to `x1`, named after its tool and size.
fn flat_ceiling(ceilings: &[BTreeMap<String, String>], size: usize, x0: f64, x1: f64) -> Series {
    let nearest = ceilings
        .iter()
        .filter(|r| r["figure"] == "13")
        .min_by_key(|r| (num(r, "size") as i64 - size as i64).unsigned_abs());
    nearest
        .map(|r| {
            let v = num(r, "value");
            let name = format!("{} {}", r["mechanism"], human_bytes(num(r, "size")));
            vec![(name, vec![(x0, v), (x1, v)])]
        })
        .unwrap_or_default()
}

/// Draws every figure whose CSV is in `dir`; prints what it wrote.
pub fn plot(dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let font = std::fs::read(FONT)
        .map_err(|e| format!("{FONT}: {e} (install fonts-dejavu-core: scripts/setup.sh)"))?;
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(font.into_boxed_slice()),
    )
    .map_err(|_| format!("{FONT}: not a font plotters can read"))?;
    let png = |name: &str| dir.join(name);
    let csv = |name: &str| read_csv(&dir.join(name));
    let mut wrote = Vec::new();
    let size = |x: &BTreeMap<String, String>| num(x, "size");
    let ceilings = csv("ceilings.csv").unwrap_or_default();
    let ceiling = |fig: &str| series(&ceilings, |r| r["figure"] == fig, size, |r| num(r, "value"));

    if let Some(rows) = csv("fig10.csv") {
        let p = png("fig10.png");
        let root = BitMapBackend::new(&p, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut data = series(&rows, |_| true, |r| num(r, "blocks"), |r| num(r, "p50_us"));
        data.extend(ceiling("10"));
        draw(
            &root,
            &Chart {
                title: "Fig. 10: synchronisation control latency (median)",
                x_desc: "number of memory blocks",
                y_desc: "latency (µs)",
                x: Scale::Linear,
                y: Scale::Linear,
                points: false,
            },
            &data,
        )?;
        root.present()?;
        wrote.push(p.clone());
    }
    if let Some(rows) = csv("fig11.csv") {
        let p = png("fig11.png");
        let root = BitMapBackend::new(&p, (1200, 500)).into_drawing_area();
        root.fill(&WHITE)?;
        let all = series(
            &rows,
            |_| true,
            |r| num(r, "transmission"),
            |r| num(r, "latency_us"),
        );
        let mut order: Vec<_> = all.into_iter().collect();
        // (a) sliding window, (b) status byte, as in the paper.
        order.sort_by_key(|(m, _)| m == "status-byte");
        let panels = root.split_evenly((1, order.len().max(1)));
        for (k, ((name, pts), area)) in order.into_iter().zip(panels.iter()).enumerate() {
            let title = format!(
                "Fig. 11({}): {name}, 3 memory blocks",
                ["a", "b", "c"][k.min(2)]
            );
            draw(
                area,
                &Chart {
                    title: &title,
                    x_desc: "transmission",
                    y_desc: "synchronisation latency (µs)",
                    x: Scale::Linear,
                    y: Scale::Linear,
                    points: true,
                },
                &vec![(name, pts)],
            )?;
        }
        root.present()?;
        wrote.push(p.clone());
    }
    let two_panels = |name: &str,
                      rows: &[BTreeMap<String, String>],
                      ycol: &str,
                      title: &str,
                      y_desc: &str,
                      extra: Option<(&str, Series)>|
     -> Result<std::path::PathBuf, Box<dyn std::error::Error>> {
        let p = png(name);
        let root = BitMapBackend::new(&p, (1300, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        let (a, b) = root.split_horizontally(650);
        for (area, small, sub) in [
            (&a, true, "(a) 64 B – 4 KB"),
            (&b, false, "(b) 8 KB and up"),
        ] {
            let keep = |r: &BTreeMap<String, String>| (num(r, "size") <= 4096.0) == small;
            let mut data = series(rows, keep, size, |r| num(r, ycol));
            if let Some((_, extra)) = &extra {
                for (n, pts) in extra {
                    let pts: Vec<_> = pts
                        .iter()
                        .copied()
                        .filter(|(x, _)| (*x <= 4096.0) == small)
                        .collect();
                    if !pts.is_empty() {
                        data.push((n.clone(), pts));
                    }
                }
            }
            draw(
                area,
                &Chart {
                    title: &format!("{title} {sub}"),
                    x_desc: "packet size (bytes)",
                    y_desc,
                    x: Scale::Log2Bytes,
                    y: if small { Scale::Linear } else { Scale::Log10 },
                    points: false,
                },
                &data,
            )?;
        }
        root.present()?;
        Ok(p.clone())
    };
    if let Some(rows) = csv("fig12.csv") {
        let extra = ceiling("12");
        wrote.push(two_panels(
            "fig12.png",
            &rows,
            "p50_us",
            "Fig. 12: transmission latency",
            "latency (µs, median)",
            Some(("perftest", extra)),
        )?);
    }
    if let Some(rows) = csv("fig13.csv") {
        // Mean over the repetitions.
        let mut sums: BTreeMap<(String, u64), (f64, f64, f64, usize)> = BTreeMap::new();
        for r in &rows {
            let e = sums
                .entry((r["mechanism"].clone(), num(r, "size") as u64))
                .or_insert((0.0, f64::MAX, 0.0, 0));
            let v = num(r, "mb_per_s");
            e.0 += v;
            e.1 = e.1.min(v);
            e.2 = e.2.max(v);
            e.3 += 1;
        }
        let means: Vec<BTreeMap<String, String>> = sums
            .iter()
            .map(|((m, s), (sum, lo, hi, n))| {
                BTreeMap::from([
                    ("mechanism".to_string(), m.clone()),
                    ("size".to_string(), s.to_string()),
                    ("mean".to_string(), (sum / *n as f64).to_string()),
                    ("min".to_string(), lo.to_string()),
                    ("max".to_string(), hi.to_string()),
                ])
            })
            .collect();
        let extra = ceiling("13");
        let p = png("fig13.png");
        let root = BitMapBackend::new(&p, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut data = series(&means, |_| true, size, |r| num(r, "mean"));
        data.extend(extra.clone());
        draw(
            &root,
            &Chart {
                title: "Fig. 13: throughput vs packet size (mean of the repetitions)",
                x_desc: "packet size (bytes)",
                y_desc: "throughput (MB/s)",
                x: Scale::Log2Bytes,
                y: Scale::Log10,
                points: false,
            },
            &data,
        )?;
        root.present()?;
        wrote.push(p.clone());
        wrote.push(two_panels(
            "fig14.png",
            &means,
            "mean",
            "Fig. 14: throughput",
            "throughput (MB/s)",
            Some(("perftest", extra)),
        )?);
    }
    if let Some(rows) = csv("fig15.csv") {
        let p = png("fig15.png");
        let root = BitMapBackend::new(&p, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        draw(
            &root,
            &Chart {
                title: "Fig. 15: sender CPU utilisation",
                x_desc: "packet size (bytes)",
                y_desc: "CPU (% of one core)",
                x: Scale::Log2Bytes,
                y: Scale::Linear,
                points: false,
            },
            &series(&rows, |_| true, size, |r| num(r, "sender_cpu_percent")),
        )?;
        root.present()?;
        wrote.push(p.clone());
    }
    if let Some(rows) = csv("fig16.csv") {
        for (fig, side) in [("16", "sender"), ("17", "receiver")] {
            let p = png(&format!("fig{fig}.png"));
            let root = BitMapBackend::new(&p, (900, 560)).into_drawing_area();
            root.fill(&WHITE)?;
            let mut values: BTreeMap<String, Vec<f64>> = BTreeMap::new();
            for r in rows.iter().filter(|r| r["side"] == side) {
                let n = num(r, "transmissions").max(1.0);
                values.insert(
                    r["mechanism"].clone(),
                    vec![
                        num(r, "sq_depth"),
                        num(r, "rq_depth"),
                        num(r, "cqs"),
                        (num(r, "send_wrs") + num(r, "recv_wrs")) / n,
                        num(r, "completions") / n,
                    ],
                );
            }
            bars(
                &root,
                &format!("Fig. {fig}: RNIC resources used at the {side}"),
                "entries / work requests per block",
                &[
                    "send queue depth",
                    "receive queue depth",
                    "completion queues",
                    "WRs per block",
                    "CQEs per block",
                ],
                &values,
            )?;
            root.present()?;
            wrote.push(p.clone());
        }
    }
    if let Some(rows) = csv("fig18.csv") {
        let p = png("fig18.png");
        let root = BitMapBackend::new(&p, (1000, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        draw(
            &root,
            &Chart {
                title: "Fig. 18: throughput while the receiver keeps a block (100–200 ms)",
                x_desc: "time (ms, 1 ms bins)",
                y_desc: "throughput (MB/s)",
                x: Scale::Linear,
                y: Scale::Linear,
                points: false,
            },
            &{
                let mut data = series(&rows, |_| true, |r| num(r, "ms"), |r| num(r, "mb_per_s"));
                data.extend(flat_ceiling(&ceilings, 64 << 10, 0.0, 300.0));
                data
            },
        )?;
        root.present()?;
        wrote.push(p.clone());
    }
    if let Some(rows) = csv("fig19.csv") {
        for (mode, file) in [("25fps", "fig19.png"), ("unpaced", "fig19-unpaced.png")] {
            let p = png(file);
            let root = BitMapBackend::new(&p, (1300, 520)).into_drawing_area();
            root.fill(&WHITE)?;
            let mut all = series(
                &rows,
                |r| r["mode"] == mode,
                |r| num(r, "ms"),
                |r| num(r, "mb_per_s"),
            );
            all.sort_by_key(|(m, _)| m == "status-byte");
            let panels = root.split_evenly((1, all.len().max(1)));
            for (k, ((name, pts), area)) in all.into_iter().zip(panels.iter()).enumerate() {
                let ys: Vec<f64> = pts.iter().map(|p| p.1).collect();
                let mean = ys.iter().sum::<f64>() / ys.len().max(1) as f64;
                let sd = (ys.iter().map(|y| (y - mean).powi(2)).sum::<f64>()
                    / ys.len().max(1) as f64)
                    .sqrt();
                let title = format!(
                    "Fig. 19({}): {name}, 12 cameras {mode} — mean {mean:.0} MB/s, CV {:.2}",
                    ["a", "b", "c"][k.min(2)],
                    if mean > 0.0 { sd / mean } else { 0.0 }
                );
                let x1 = pts.last().map_or(1.0, |p| p.0);
                let bin = match &pts[..] {
                    [a, b, ..] => b.0 - a.0,
                    _ => 1.0,
                };
                let x_desc = format!("time (ms, {bin:.0} ms bins)");
                let mut data = vec![(name, pts)];
                data.extend(flat_ceiling(&ceilings, 640 * 480 * 3, 0.0, x1));
                draw(
                    area,
                    &Chart {
                        title: &title,
                        x_desc: &x_desc,
                        y_desc: "total throughput (MB/s)",
                        x: Scale::Linear,
                        y: Scale::Linear,
                        points: false,
                    },
                    &data,
                )?;
            }
            root.present()?;
            wrote.push(p.clone());
        }
    }
    for p in &wrote {
        println!("wrote {}", p.display());
    }
    if wrote.is_empty() {
        return Err(format!("no figure CSV in {} (run bench paper first)", dir.display()).into());
    }
    Ok(())
}
