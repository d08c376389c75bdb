//! PNG plots of the results, with the targets drawn in.

use std::path::Path;

use anyhow::{anyhow, Context as _, Result};
use plotters::prelude::*;

use super::{
    control_plane,
    datapath::{self, PathKind},
    e2e,
    stats::Summary,
};

pub const DATAPATH_SERVICES: &str = "datapath-services.png";
pub const DATAPATH_BACKENDS: &str = "datapath-backends.png";
pub const CONTROL_PLANE: &str = "control-plane.png";
pub const E2E: &str = "e2e.png";

const FONT: &str = "sans-serif";
/// DejaVu Sans (Debian's fonts-dejavu-core): plotters draws text with a font it is given.
const FONT_FILES: [&str; 2] =
    ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/dejavu/DejaVuSans.ttf"];

fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let path = FONT_FILES.iter().find(|path| Path::new(path).exists()).ok_or_else(|| {
                format!("no font for the plots: install fonts-dejavu-core ({})", FONT_FILES[0])
            })?;
            let bytes = std::fs::read(path).map_err(|error| format!("{path}: {error}"))?;
            plotters::style::register_font(FONT, FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
                .map_err(|_| format!("{path} is not a usable font"))
        })
        .clone()
        .map_err(|error| anyhow!(error))
}

fn color(i: usize) -> RGBColor {
    const PALETTE: [RGBColor; 7] = [
        RGBColor(0x1f, 0x77, 0xb4),
        RGBColor(0xff, 0x7f, 0x0e),
        RGBColor(0x2c, 0xa0, 0x2c),
        RGBColor(0xd6, 0x27, 0x28),
        RGBColor(0x94, 0x67, 0xbd),
        RGBColor(0x8c, 0x56, 0x4b),
        RGBColor(0x7f, 0x7f, 0x7f),
    ];
    PALETTE[i % PALETTE.len()]
}

/// Paths drawn in the datapath plots.
const PLOTTED: [PathKind; 7] = [
    PathKind::NewFlow,
    PathKind::Established,
    PathKind::Reply,
    PathKind::Miss,
    PathKind::NewFlowCold,
    PathKind::NewFlowSpreadCold,
    PathKind::EstablishedCold,
];

/// A series: its label and (x, cost) points, in x order (a line joins them in that order).
type Series = (String, Vec<(f64, Summary)>);

/// `points` ordered by x: results are stored in the order they were measured, which is not
/// always the axis's.
fn by_x(mut points: Vec<(f64, Summary)>) -> Vec<(f64, Summary)> {
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    points
}

/// What a legend entry shows beside its label.
#[derive(Clone, Copy)]
enum Key {
    Line { color: RGBColor, dashed: bool },
    Cross(RGBColor),
}

/// Draws a legend on its own area, beside or below the plot, so that it never hides data:
/// entries fill `columns` columns, row by row.
fn legend(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    entries: &[(String, Key)],
    columns: usize,
) -> Result<()> {
    const ROW: i32 = 20;
    let (width, _) = area.dim_in_pixel();
    let column_width = (width as usize / columns.max(1)) as i32;
    for (i, (label, key)) in entries.iter().enumerate() {
        let x = 10 + (i % columns.max(1)) as i32 * column_width;
        let y = 12 + (i / columns.max(1)) as i32 * ROW;
        match *key {
            Key::Line { color, dashed } => {
                let style = ShapeStyle::from(&color).stroke_width(2);
                if dashed {
                    area.draw(&PathElement::new(vec![(x, y), (x + 10, y)], style))?;
                    area.draw(&PathElement::new(vec![(x + 16, y), (x + 26, y)], style))?;
                } else {
                    area.draw(&PathElement::new(vec![(x, y), (x + 26, y)], style))?;
                }
            }
            Key::Cross(color) => {
                area.draw(&Cross::new((x + 13, y), 6, ShapeStyle::from(&color).stroke_width(2)))?
            }
        }
        area.draw(&Text::new(label.clone(), (x + 34, y - 8), (FONT, 14)))?;
    }
    Ok(())
}

/// Tick labels without a spurious ".0" and with k/M for thousands and millions (10000 -> 10k).
fn tick(value: f64) -> String {
    let (scaled, suffix) = match value.abs() {
        v if v >= 1e6 => (value / 1e6, "M"),
        v if v >= 1e3 => (value / 1e3, "k"),
        _ => (value, ""),
    };
    let digits = if scaled.abs() >= 10.0 || scaled.fract().abs() < 1e-9 { 0 } else { 1 };
    let text = format!("{scaled:.digits$}");
    format!("{}{suffix}", text.strip_suffix(".0").unwrap_or(&text))
}

/// The cold (one packet per call) paths are drawn dashed.
fn dashed(label: &str) -> bool {
    label.contains("cold")
}

/// Draws the plots for whichever results there are; returns the files written.
pub fn draw(
    dir: &Path,
    datapath: Option<&datapath::Results>,
    control: Option<&control_plane::Results>,
    e2e: Option<&e2e::Results>,
) -> Result<Vec<&'static str>> {
    register_font()?;
    let mut written = Vec::new();
    if let Some(results) = datapath {
        let services = &results.settings.services_axis;
        let backends = results.settings.default_backends;
        let series = |x_of: &dyn Fn(&datapath::Cell) -> Option<f64>| -> Vec<Series> {
            PLOTTED
                .iter()
                .map(|&kind| {
                    let points = results
                        .cells
                        .iter()
                        .filter_map(|cell| Some((x_of(cell)?, cell.path(kind)?.program)))
                        .collect();
                    (kind.label().to_owned(), points)
                })
                .collect()
        };
        let by_services = series(&|cell| {
            (cell.backends_per_service == backends && services.contains(&cell.services))
                .then_some(cell.services as f64)
        });
        latency_plot(
            &dir.join(DATAPATH_SERVICES),
            &format!("vipr_tc_ingress per packet, {backends} backends per service"),
            "services",
            &by_services,
        )?;
        written.push(DATAPATH_SERVICES);
        let axis_services = results.settings.backends_axis_services;
        let by_backends = series(&|cell| {
            (cell.services == axis_services
                && results.settings.backends_axis.contains(&cell.backends_per_service))
            .then_some(cell.backends_per_service as f64)
        });
        latency_plot(
            &dir.join(DATAPATH_BACKENDS),
            &format!("vipr_tc_ingress per packet, {axis_services} services"),
            "backends per service",
            &by_backends,
        )?;
        written.push(DATAPATH_BACKENDS);
    }
    if let Some(results) = control {
        control_plot(&dir.join(CONTROL_PLANE), results)?;
        written.push(CONTROL_PLANE);
    }
    if let Some(results) = e2e {
        e2e_plot(&dir.join(E2E), results)?;
        written.push(E2E);
    }
    Ok(written)
}

fn x_range(points: impl Iterator<Item = f64>) -> (f64, f64) {
    let (low, high) = points.fold((f64::MAX, f64::MIN), |(low, high), x| (low.min(x), high.max(x)));
    if low > high {
        return (1.0, 10.0);
    }
    (low / 2.0, high * 2.0)
}

fn latency_plot(path: &Path, title: &str, x_label: &str, series: &[Series]) -> Result<()> {
    let root = BitMapBackend::new(path, (1100, 620)).into_drawing_area();
    root.fill(&WHITE)?;
    let (plot_area, legend_area) = root.split_horizontally(800);
    let (x_low, x_high) = x_range(series.iter().flat_map(|(_, points)| points.iter().map(|(x, _)| *x)));
    let values = series.iter().flat_map(|(_, points)| points.iter().flat_map(|(_, s)| [s.min, s.max]));
    let (y_low, y_high) = values
        .chain([120.0, 300.0])
        .filter(|y| *y > 0.0)
        .fold((f64::MAX, f64::MIN), |(low, high), y| (low.min(y), high.max(y)));
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(title, (FONT, 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d((x_low..x_high).log_scale(), (y_low / 1.5..y_high * 1.5).log_scale())?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc("ns per packet (program, median; bars: min-max)")
        .x_label_formatter(&|x| thousands(*x))
        .y_label_formatter(&|y| tick(*y))
        .label_style((FONT, 14))
        .draw()?;
    let mut keys = Vec::new();
    let target_color = RGBColor(0xaa, 0x00, 0x00);
    for (target, label) in [(120.0, "target: established <= 120 ns"), (300.0, "target: new flow <= 300 ns")] {
        let style = ShapeStyle::from(&target_color).stroke_width(1);
        chart.draw_series(DashedLineSeries::new(vec![(x_low, target), (x_high, target)], 8, 6, style))?;
        keys.push((label.to_owned(), Key::Line { color: target_color, dashed: true }));
    }
    for (i, (label, points)) in series.iter().enumerate() {
        if points.is_empty() {
            continue;
        }
        let points = by_x(points.clone());
        let style = ShapeStyle::from(&color(i)).stroke_width(2);
        let line = points.iter().map(|(x, s)| (*x, s.median));
        if dashed(label) {
            chart.draw_series(DashedLineSeries::new(line, 10, 5, style))?;
        } else {
            chart.draw_series(LineSeries::new(line, style))?;
        }
        keys.push((label.clone(), Key::Line { color: color(i), dashed: dashed(label) }));
        chart.draw_series(points.iter().map(|(x, s)| {
            ErrorBar::new_vertical(*x, s.min, s.median, s.max, ShapeStyle::from(&color(i)).filled(), 8)
        }))?;
    }
    legend(&legend_area.margin(60, 0, 0, 0), &keys, 1)?;
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn thousands(x: f64) -> String {
    match x {
        x if x >= 1e6 && (x / 1e6).fract() == 0.0 => format!("{}M", x / 1e6),
        x if x >= 1e3 && (x / 1e3).fract() == 0.0 => format!("{}k", x / 1e3),
        x if x >= 1.0 && x.fract() == 0.0 => format!("{x}"),
        _ => String::new(),
    }
}

const CONTROL_X: &str = "services (10 endpoints each)";

/// Four panels over the number of services, one line per mode: TCP connections/s and p99
/// latency to the cluster IP, UDP transactions/s to the cluster IP and to the NodePort.
fn e2e_plot(path: &Path, results: &e2e::Results) -> Result<()> {
    let root = BitMapBackend::new(path, (1400, 1100)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((2, 2));
    let (x_low, x_high) = x_range(results.cells.iter().map(|cell| cell.services as f64));
    let x_desc = "services (the target has 3 endpoints, the others 1)";
    let series = |kind: e2e::Kind, value: fn(&e2e::Measurement) -> Summary| -> Vec<Series> {
        e2e::Mode::ALL
            .into_iter()
            .map(|mode| {
                let points = results
                    .cells
                    .iter()
                    .filter(|cell| cell.mode == mode)
                    .filter_map(|cell| Some((cell.services as f64, value(cell.measurement(kind)?))))
                    .collect();
                (mode.label().to_owned(), points)
            })
            .filter(|(_, points): &Series| !points.is_empty())
            .collect()
    };
    let tcp_rate = series(e2e::Kind::TcpClusterIp, |m| m.rate);
    // The ratio targets, drawn where they apply: 1.5x iptables's rate at 10k, 1.1x ebpf's own
    // p99 at 1 service.
    let at = |series: &[Series], label: &str, x: f64| -> Option<f64> {
        let (_, points) = series.iter().find(|(l, _)| l == label)?;
        points.iter().find(|(px, _)| *px == x).map(|(_, s)| s.median)
    };
    let mut rate_targets = Vec::new();
    if let Some(iptables) = at(&tcp_rate, e2e::Mode::IptablesNft.label(), 10_000.0) {
        rate_targets.push((10_000.0, iptables * 1.5, "target: ebpf >= 1.5x iptables at 10k"));
    }
    log_panel(
        &panels[0],
        "TCP connections/s to a cluster IP",
        "connections/s",
        (x_low, x_high),
        &tcp_rate,
        &rate_targets,
        x_desc,
    )?;
    let p99 = series(e2e::Kind::TcpClusterIp, |m| m.p99_us);
    let mut p99_targets = Vec::new();
    if let Some(one) = at(&p99, e2e::Mode::Ebpf.label(), 1.0) {
        p99_targets.push((30_000.0, one * 1.1, "target: ebpf p99 at 30k <= 1.1x at 1"));
    }
    log_panel(
        &panels[1],
        "TCP transaction p99 latency (connect to reply)",
        "µs",
        (x_low, x_high),
        &p99,
        &p99_targets,
        x_desc,
    )?;
    let udp = series(e2e::Kind::UdpClusterIp, |m| m.rate);
    log_panel(
        &panels[2],
        "UDP request/response to a cluster IP",
        "transactions/s",
        (x_low, x_high),
        &udp,
        &[],
        x_desc,
    )?;
    let node_port = series(e2e::Kind::UdpNodePort, |m| m.rate);
    log_panel(
        &panels[3],
        "UDP request/response to a NodePort, from outside",
        "transactions/s",
        (x_low, x_high),
        &node_port,
        &[],
        x_desc,
    )?;
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn control_plot(path: &Path, results: &control_plane::Results) -> Result<()> {
    let root = BitMapBackend::new(path, (1500, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 3));
    let sizes = &results.sizes;
    let x = |size: &control_plane::SizeResult| size.services as f64;
    let (x_low, x_high) = x_range(sizes.iter().map(x));

    // Sync from scratch, with the 1 s target at 10k services.
    let scratch: Vec<(f64, Summary)> = sizes.iter().map(|s| (x(s), s.sync_ms)).collect();
    let translate: Vec<(f64, Summary)> = sizes.iter().map(|s| (x(s), s.translate_ms)).collect();
    log_panel(
        &panels[0],
        "programming from scratch",
        "ms",
        (x_low, x_high),
        &[
            ("sync (desired state -> maps)".into(), scratch),
            ("translation (objects -> desired state)".into(), translate),
        ],
        &[(10_000.0, 1_000.0, "target: 10k x 10 in < 1 s")],
        CONTROL_X,
    )?;
    // One endpoint change.
    let change_sync: Vec<(f64, Summary)> = sizes.iter().map(|s| (x(s), s.change_sync_ms)).collect();
    let change_total: Vec<(f64, Summary)> = sizes.iter().map(|s| (x(s), s.change_total_ms)).collect();
    log_panel(
        &panels[1],
        "one endpoint change",
        "ms",
        (x_low, x_high),
        &[("sync of the changed state".into(), change_sync), ("translation + sync".into(), change_total)],
        &[(10_000.0, 10.0, "target: < 10 ms at 10k")],
        CONTROL_X,
    )?;
    // Memory.
    let rss: Vec<(f64, Summary)> = sizes.iter().map(|s| (x(s), s.rss_after_sync_mib)).collect();
    let hwm: Vec<(f64, Summary)> = sizes.iter().map(|s| (x(s), s.hwm_mib)).collect();
    let before: Vec<(f64, Summary)> = sizes.iter().map(|s| (x(s), s.rss_before_start_mib)).collect();
    log_panel(
        &panels[2],
        "agent memory",
        "MiB",
        (x_low, x_high),
        &[
            ("RSS after the sync".into(), rss),
            ("peak RSS (VmHWM)".into(), hwm),
            ("RSS of the objects alone".into(), before),
        ],
        &[(10_000.0, 150.0, "target: < 150 MiB at 10k")],
        CONTROL_X,
    )?;
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// A log-log panel over services, its legend below it; targets are drawn as a red cross at
/// (services, value).
fn log_panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    title: &str,
    unit: &str,
    (x_low, x_high): (f64, f64),
    series: &[Series],
    targets: &[(f64, f64, &str)],
    x_desc: &str,
) -> Result<()> {
    let (width, height) = area.dim_in_pixel();
    // Two legend columns where the longest label fits in half the width (about 7 px a
    // character at this size), else one.
    let longest = series.iter().map(|(label, _)| label.len()).chain(targets.iter().map(|t| t.2.len())).max();
    let columns = if longest.unwrap_or(0) * 7 + 60 <= width as usize / 2 { 2 } else { 1 };
    let rows = (series.len() + targets.len()).div_ceil(columns) as u32;
    let (plot_area, legend_area) = area.split_vertically(height.saturating_sub(16 + rows * 20));
    let values = series.iter().flat_map(|(_, points)| points.iter().flat_map(|(_, s)| [s.min, s.max]));
    let values = values.chain(targets.iter().map(|(_, y, _)| *y));
    let (y_low, y_high) = values.fold((f64::MAX, f64::MIN), |(low, high), y| (low.min(y), high.max(y)));
    let (y_low, y_high) =
        if y_low > y_high || y_low <= 0.0 { (0.01, 10.0) } else { (y_low / 3.0, y_high * 3.0) };
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(title, (FONT, 20))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d((x_low..x_high).log_scale(), (y_low..y_high).log_scale())?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(unit)
        .x_label_formatter(&|x| thousands(*x))
        .y_label_formatter(&|y| tick(*y))
        .label_style((FONT, 13))
        .draw()?;
    let mut keys = Vec::new();
    let red = RGBColor(0xcc, 0x00, 0x00);
    for (x, y, label) in targets {
        chart.draw_series(std::iter::once(Cross::new(
            (*x, *y),
            9,
            ShapeStyle::from(&red).stroke_width(3),
        )))?;
        keys.push(((*label).to_owned(), Key::Cross(red)));
    }
    for (i, (label, points)) in series.iter().enumerate() {
        let points = by_x(points.clone());
        let style = ShapeStyle::from(&color(i)).stroke_width(2);
        chart.draw_series(LineSeries::new(points.iter().map(|(x, s)| (*x, s.median)), style))?;
        keys.push((label.clone(), Key::Line { color: color(i), dashed: false }));
        chart.draw_series(points.iter().map(|(x, s)| {
            ErrorBar::new_vertical(*x, s.min, s.median, s.max, ShapeStyle::from(&color(i)).filled(), 8)
        }))?;
    }
    legend(&legend_area.margin(0, 0, 70, 0), &keys, columns)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_read_as_numbers_not_floats() {
        assert_eq!(tick(10_000.0), "10k");
        assert_eq!(tick(1_000.0), "1k");
        assert_eq!(tick(300_000.0), "300k");
        assert_eq!(tick(2_500.0), "2.5k");
        assert_eq!(tick(100.0), "100");
        assert_eq!(tick(0.5), "0.5");
        assert_eq!(tick(3_000_000.0), "3M");
    }

    #[test]
    fn lines_join_points_in_x_order() {
        let point = |x: f64| (x, Summary::of(&[x]).unwrap());
        let xs: Vec<f64> = by_x(vec![point(1.0), point(1000.0), point(10.0), point(100.0)])
            .into_iter()
            .map(|(x, _)| x)
            .collect();
        assert_eq!(xs, [1.0, 10.0, 100.0, 1000.0]);
    }
}
