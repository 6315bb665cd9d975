//! The loss curve as a PNG: training loss per step (log scale, left axis)
//! and held-out exact-match accuracy (right axis).
//!
//! Text is drawn with a font compiled into the binary (an ASCII subset of
//! DejaVu Sans, `assets/fonts/`), so plotting needs no system fonts or
//! fontconfig: it works the same on a bare CI machine.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use super::eval::EvalPoint;
use tessera::error::{Error, Result};

const FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans-ascii.ttf");
const FAMILY: &str = "sans-serif";
const SIZE: (u32, u32) = (900, 540);

/// Writes the curve of `losses` (one per step) and `evals` to `path`.
pub fn plot_losses(path: &Path, title: &str, losses: &[f64], evals: &[EvalPoint]) -> Result<()> {
    plot_curve(path, title, losses, evals, "held-out exact match")
}

/// [`plot_losses`] with the accuracy axis (each eval's `exact_match`)
/// called `accuracy_label`.
pub fn plot_curve(
    path: &Path,
    title: &str,
    losses: &[f64],
    evals: &[EvalPoint],
    accuracy_label: &str,
) -> Result<()> {
    register_font()?;
    draw(path, title, losses, evals, accuracy_label).map_err(|e| {
        Error::io(format!(
            "{}: cannot draw the loss curve: {e}",
            path.display()
        ))
    })
}

/// Registers the embedded font once per process (plotters keeps a global
/// font table).
fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED
        .get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(Error::io("the embedded plot font does not parse"))
    }
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn draw(
    path: &Path,
    title: &str,
    losses: &[f64],
    evals: &[EvalPoint],
    accuracy_label: &str,
) -> DrawResult {
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let steps = losses.len().max(2);
    let (low, high) = loss_range(losses);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FAMILY, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .right_y_label_area_size(60)
        .build_cartesian_2d(1..steps, (low..high).log_scale())?
        // Headroom above 100 % keeps a perfect score off the frame.
        .set_secondary_coord(1..steps, 0.0..1.05);
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("training loss (log)")
        .label_style((FAMILY, 14))
        .draw()?;
    chart
        .configure_secondary_axes()
        .y_desc(accuracy_label)
        .label_style((FAMILY, 14))
        .draw()?;
    let loss_points = losses.iter().enumerate().map(|(i, &l)| (i + 1, l.max(low)));
    chart
        .draw_series(LineSeries::new(loss_points, &BLUE))?
        .label("loss")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLUE));
    let accuracy_points = evals.iter().map(|e| (e.step, e.accuracy.exact_match));
    chart
        .draw_secondary_series(LineSeries::new(accuracy_points, RED.stroke_width(2)).point_size(3))?
        .label(accuracy_label)
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], RED.stroke_width(2)));
    chart
        .configure_series_labels()
        .label_font((FAMILY, 14))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::MiddleRight)
        .draw()?;
    root.present()?;
    Ok(())
}

/// A log-scale range covering the finite, positive losses (with a margin).
fn loss_range(losses: &[f64]) -> (f64, f64) {
    let positive = losses.iter().copied().filter(|l| l.is_finite() && *l > 0.0);
    let (low, high) = positive.fold((f64::INFINITY, 0.0f64), |(lo, hi), l| {
        (lo.min(l), hi.max(l))
    });
    if low.is_finite() && high > low {
        (low * 0.8, high * 1.25)
    } else {
        (1e-3, 10.0)
    }
}
