//! The roofline picture of decode (`memwall wall --svg FILE`): log-log arithmetic intensity
//! (FLOPs per byte read from device memory) against attainable FLOP/s, the device's bandwidth and
//! compute roofs, and for each model the decode steps at batch 1, 2, 4, ..., 1024.
//!
//! A point's position is its step's intensity and the FLOP/s the roofline allows it
//! (`FLOPs / max(bytes / bandwidth, FLOPs / peak)`), so every point sits on the roof: left of the
//! ridge it is memory-bound, right of it compute-bound. Measured decode steps (a rate given with
//! `--achieved-tok-s`, or recorded by `benches/decode.rs`) are drawn as filled marks at the FLOP/s
//! they achieved, below the roof by the fraction of the wall they reached.

use plotters::prelude::*;

use super::count::WeightDtype;
use super::estimate::{self, peak_flops};
use super::{Device, Error, Model};

/// The batches drawn for each model.
pub const BATCHES: [u64; 11] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];

const WIDTH: u32 = 1200;
const HEIGHT: u32 = 760;

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// A decode step on the roofline: (batch, FLOPs per byte, attainable FLOP/s).
pub type DecodePoint = (u64, f64, f64);

/// A measured decode step: its arithmetic intensity (FLOPs per byte read) and the FLOP/s it
/// achieved (FLOPs per step x steps per second).
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredPoint {
    pub label: String,
    pub intensity: f64,
    pub flops_per_s: f64,
}

/// One model's decode points.
pub fn decode_points(model: &Model, dtype: WeightDtype, device: &Device, context: u64) -> Vec<DecodePoint> {
    BATCHES
        .iter()
        .map(|&b| {
            let s = estimate::step(&model.config, dtype, device, b, context);
            (b, s.arithmetic_intensity, s.attainable_flops)
        })
        .collect()
}

/// A value with an SI prefix and up to four significant digits: 3.35e12 -> "3.35 T",
/// 9.895e14 -> "989.5 T", 1e15 -> "1 P".
fn si(v: f64) -> String {
    const PREFIXES: [(f64, &str); 6] =
        [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, "")];
    let (scale, prefix) = PREFIXES.iter().copied().find(|&(scale, _)| v >= scale).unwrap_or((1.0, ""));
    let x = v / scale;
    let digits = if x >= 100.0 {
        1
    } else if x >= 10.0 {
        2
    } else {
        3
    };
    let text = format!("{x:.digits$}");
    let text = if text.contains('.') { text.trim_end_matches('0').trim_end_matches('.') } else { &text };
    format!("{text} {prefix}")
}

/// The SVG text of the roofline of `models` in `dtype` on `device` at context `context`.
pub fn svg(
    models: &[Model],
    dtype: WeightDtype,
    device: &Device,
    context: u64,
    measured: &[MeasuredPoint],
) -> Result<String, Error> {
    if models.is_empty() {
        return Err(Error::Plot("no model to draw".into()));
    }
    let peak = peak_flops(device, dtype);
    let bw = device.bandwidth;
    let series: Vec<(&Model, Vec<DecodePoint>)> =
        models.iter().map(|m| (m, decode_points(m, dtype, device, context))).collect();

    // Axis ranges: every point, and the ridge with a decade on each side.
    let ridge = peak.map(|p| p / bw);
    let measured: Vec<&MeasuredPoint> = measured
        .iter()
        .filter(|m| {
            m.intensity.is_finite() && m.intensity > 0.0 && m.flops_per_s.is_finite() && m.flops_per_s > 0.0
        })
        .collect();
    let xs = series
        .iter()
        .flat_map(|(_, pts)| pts.iter().map(|p| p.1))
        .chain(measured.iter().map(|m| m.intensity));
    let (x_lo, x_hi) = xs.fold((f64::INFINITY, 0.0_f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let x_lo = 10f64.powf((x_lo / 2.0).log10().floor());
    // Room right of the ridge for the flat roof and its label.
    let x_hi = 10f64.powf((x_hi * 3.0).max(ridge.unwrap_or(0.0) * 20.0).log10().ceil());
    let y_hi_data =
        peak.unwrap_or_else(|| series.iter().flat_map(|(_, p)| p.iter().map(|q| q.2)).fold(0.0, f64::max));
    let y_lo_data = measured.iter().map(|m| m.flops_per_s / 2.0).fold(x_lo * bw, f64::min);
    let y_lo = 10f64.powf(y_lo_data.log10().floor());
    // Headroom above the roof for the note and the roof's label.
    let y_hi = 10f64.powf((y_hi_data * 30.0).log10().ceil());
    if !(x_lo.is_finite() && x_hi > x_lo && y_lo.is_finite() && y_hi > y_lo) {
        return Err(Error::Plot(format!("degenerate axis ranges x {x_lo}..{x_hi}, y {y_lo}..{y_hi}")));
    }

    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, (WIDTH, HEIGHT)).into_drawing_area();
        let plot = |e: &dyn std::fmt::Display| Error::Plot(e.to_string());
        root.fill(&WHITE).map_err(|e| plot(&e))?;
        let peak_text = match peak {
            Some(p) => {
                let unit =
                    if dtype == WeightDtype::Fp8 && device.fp8_flops.is_some() { "fp8" } else { "bf16" };
                format!("{}FLOP/s dense {unit}", si(p))
            }
            None => "compute peak unknown".to_string(),
        };
        // This machine's name carries its figures; the caption states them once, with their origin.
        let (name, bw_origin, peak_origin) = if device.key == super::THIS_MACHINE {
            ("this machine", " (measured read)", " (estimated)")
        } else {
            (device.name.as_str(), "", "")
        };
        let caption = format!(
            "Decode roofline on {name}: {}B/s memory{bw_origin}, {peak_text}{peak_origin} ({} weights, context \
             {context} tokens)",
            si(bw),
            dtype.name()
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 19))
            .margin(20)
            .x_label_area_size(55)
            .y_label_area_size(115)
            .build_cartesian_2d((x_lo..x_hi).log_scale(), (y_lo..y_hi).log_scale())
            .map_err(|e| plot(&e))?;
        chart
            .configure_mesh()
            .x_desc("Arithmetic intensity (FLOPs per byte read from device memory)")
            .y_desc("Attainable FLOP/s")
            .x_label_formatter(&|v| si(*v).trim_end().to_string())
            .y_label_formatter(&|v| format!("{}FLOP/s", si(*v)))
            .axis_desc_style(("sans-serif", 17))
            .label_style(("sans-serif", 14))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()
            .map_err(|e| plot(&e))?;

        // The roofline min(peak, intensity * bandwidth): straight segments on log-log axes.
        let roof: Vec<(f64, f64)> = match (peak, ridge) {
            (Some(p), Some(r)) if r > x_lo && r < x_hi => vec![(x_lo, x_lo * bw), (r, p), (x_hi, p)],
            (Some(p), _) => vec![(x_lo, p.min(x_lo * bw)), (x_hi, p.min(x_hi * bw))],
            (None, _) => vec![(x_lo, x_lo * bw), (x_hi, x_hi * bw)],
        };
        let roof_label = match (peak, ridge) {
            (Some(_), Some(r)) => {
                format!("roofline: memory roof up to the ridge at {r:.0} FLOP/byte, then compute roof")
            }
            _ => "memory roof (compute peak unknown)".to_string(),
        };
        chart
            .draw_series(LineSeries::new(roof, BLACK.stroke_width(3)))
            .map_err(|e| plot(&e))?
            .label(roof_label)
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(3)));

        if let (Some(p), Some(r)) = (peak, ridge) {
            let label = |text: String, at: (f64, f64)| Text::new(text, at, ("sans-serif", 16));
            chart
                .draw_series(std::iter::once(label(
                    format!("compute roof: {}FLOP/s", si(p)),
                    (r * 4.0, p * 2.0),
                )))
                .map_err(|e| plot(&e))?;
            // The ridge: where the two roofs meet.
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(r, y_lo), (r, p)],
                    6,
                    4,
                    RGBColor(120, 120, 120).stroke_width(1),
                ))
                .map_err(|e| plot(&e))?;
            chart
                .draw_series(std::iter::once(label(format!("ridge: {r:.0} FLOP/byte"), (r * 1.1, p / 3.0))))
                .map_err(|e| plot(&e))?;
            // Below the sloped roof, where no point lies.
            let x = x_lo * (r / x_lo).powf(0.45);
            chart
                .draw_series(std::iter::once(label(
                    format!("memory roof: {}B/s x intensity", si(bw)),
                    (x, x * bw / 8.0),
                )))
                .map_err(|e| plot(&e))?;
        }

        // Models drawn largest circle first, so coinciding points show as concentric rings.
        let mut placed: Vec<(f64, f64)> = Vec::new();
        for (i, (model, pts)) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let radius = 4 + 2 * (series.len() - 1 - i).min(6) as i32;
            let line: Vec<(f64, f64)> = pts.iter().map(|p| (p.1, p.2)).collect();
            chart.draw_series(LineSeries::new(line, color.stroke_width(1))).map_err(|e| plot(&e))?;
            chart
                .draw_series(pts.iter().map(|p| Circle::new((p.1, p.2), radius, color.stroke_width(2))))
                .map_err(|e| plot(&e))?
                .label(format!("{}: decode at batch 1, 2, 4, ..., 1024", model.name))
                .legend(move |(x, y)| Circle::new((x + 10, y), 5, color.stroke_width(2)));
            // The batch beside each point, unless another label is already there.
            for &(batch, x, y) in pts {
                let (lx, ly) = (x.log10(), y.log10());
                if placed.iter().any(|&(px, py)| (px - lx).abs() < 0.2 && (py - ly).abs() < 0.2) {
                    continue;
                }
                placed.push((lx, ly));
                // Above-left of a point on the sloped roof, above one on the flat roof.
                let at = if peak.is_some_and(|p| y >= 0.8 * p) {
                    (x / 1.15, y * 1.6)
                } else {
                    (x / 1.9, y * 1.35)
                };
                chart
                    .draw_series(std::iter::once(Text::new(
                        batch.to_string(),
                        at,
                        ("sans-serif", 13).into_font().color(&color),
                    )))
                    .map_err(|e| plot(&e))?;
            }
        }
        // Measured steps: filled, below the roof by the fraction of the wall they reached.
        let red = RGBColor(200, 0, 0);
        for m in &measured {
            let at = (m.intensity, m.flops_per_s);
            chart
                .draw_series(std::iter::once(TriangleMarker::new(at, 8, red.filled())))
                .map_err(|e| plot(&e))?
                .label(format!("measured: {}", m.label))
                .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 6, red.filled()));
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("measured {}FLOP/s", si(m.flops_per_s)),
                    (m.intensity * 1.15, m.flops_per_s / 1.6),
                    ("sans-serif", 13).into_font().color(&red),
                )))
                .map_err(|e| plot(&e))?;
        }
        chart
            .draw_series(std::iter::once(Text::new(
                "Numbers beside the points: the batch (sequences decoded together). Every point sits on the roof: \
                 the floor max(bytes/bandwidth, FLOPs/peak).",
                (x_lo * 1.3, y_hi / 2.0),
                ("sans-serif", 14),
            )))
            .map_err(|e| plot(&e))?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(|e| plot(&e))?;
        root.present().map_err(|e| plot(&e))?;
    }
    Ok(text)
}
