//! Draw the `--plot` SVG of a `umdev bench pin --json` file again, without measuring:
//! `cargo run -p umdev-bench --example replot -- docs/bench/pin.json docs/bench/pin.svg`.
//!
//! The committed plot in docs/ is redrawn this way when the plot changes, so it keeps
//! showing the run the tables beside it come from.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [json, svg] = args.as_slice() else {
        eprintln!("usage: replot PIN.json OUT.svg");
        return ExitCode::from(2);
    };
    let drawn = std::fs::read_to_string(json)
        .map_err(umdev_bench::BenchError::from)
        .and_then(|text| umdev_bench::plot::pin_svg_from_json(&text))
        .and_then(|plot| Ok(std::fs::write(svg, plot)?));
    match drawn {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("replot {json}: {e}");
            ExitCode::FAILURE
        }
    }
}
