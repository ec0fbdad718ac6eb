//! `memwall scenario --svg FILE`: decode tokens/s against batch size, measured (decode-only steps
//! of every scenario run, by batch) over the roofline's prediction `batch / floor of a step`.

use memwall_model::ModelConfig;
use plotters::prelude::*;

use super::BatchSteps;
use super::predict::roofline_tokens_per_s;
use crate::wall::{Device, Error, WeightDtype};

/// The SVG text. `measured`: decode-only steps by batch; `max_batch`: the slots of the run.
pub fn svg(
    model: &str,
    config: &ModelConfig,
    dtype: WeightDtype,
    device: &Device,
    context: u64,
    measured: &[BatchSteps],
    max_batch: usize,
) -> Result<String, Error> {
    let plot = |e: &dyn std::fmt::Display| Error::Plot(e.to_string());
    let top = max_batch.max(measured.iter().map(|b| b.batch).max().unwrap_or(1)).max(2) as u64;
    let roof: Vec<(f64, f64)> =
        (1..=top).map(|b| (b as f64, roofline_tokens_per_s(config, dtype, device, b, context))).collect();
    let points: Vec<(f64, f64)> = measured
        .iter()
        .filter(|b| b.steps > 0 && b.seconds > 0.0)
        .map(|b| (b.batch as f64, b.tokens_per_s()))
        .collect();
    let ys = roof.iter().chain(&points).map(|p| p.1).filter(|y| y.is_finite() && *y > 0.0);
    let (lo, hi) = ys.fold((f64::INFINITY, 0.0f64), |(l, h), y| (l.min(y), h.max(y)));
    if !(lo.is_finite() && hi >= lo) {
        return Err(Error::Plot("no positive tokens/s to draw".into()));
    }
    let (y_lo, y_hi) = (10f64.powf((lo / 2.0).log10().floor()), 10f64.powf((hi * 2.0).log10().ceil()));
    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, (1000, 640)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "{model}: decode tokens/s against batch, measured over the roofline of {}",
                    device.name
                ),
                ("sans-serif", 18),
            )
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(90)
            .build_cartesian_2d((1.0..top as f64 * 1.2).log_scale(), (y_lo..y_hi).log_scale())
            .map_err(|e| plot(&e))?;
        chart
            .configure_mesh()
            .x_desc("Batch (sequences decoded together)")
            .y_desc("Decode tokens/s")
            .axis_desc_style(("sans-serif", 16))
            .draw()
            .map_err(|e| plot(&e))?;
        let blue = RGBColor(31, 119, 180);
        chart
            .draw_series(LineSeries::new(roof, blue.stroke_width(2)))
            .map_err(|e| plot(&e))?
            .label(format!(
                "roofline: batch / max(bytes/bandwidth, FLOPs/peak), {} weights, context {context}",
                dtype.name()
            ))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], blue.stroke_width(2)));
        let red = RGBColor(200, 0, 0);
        chart
            .draw_series(points.iter().map(|&p| TriangleMarker::new(p, 7, red.filled())))
            .map_err(|e| plot(&e))?
            .label("measured: decode-only steps of the scenario runs (engine clock)")
            .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 6, red.filled()));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()
            .map_err(|e| plot(&e))?;
        root.present().map_err(|e| plot(&e))?;
    }
    Ok(text)
}
