//! Measured decode rates: the records `benches/decode.rs` writes (`target/memwall/decode.json`, one
//! per batch size it ran) and `memwall wall` reads, so the report can set what was achieved beside
//! the wall it predicts and draw each batch as a measured point of the roofline.
//!
//! The record carries the checkpoint's `config.json`, so the report can count the model's bytes
//! itself, and the bytes and FLOPs of a step as the model's op list (`OpCost`) counted them in
//! the run. The wall of the record is the memory wall at the read peak measured in the same run,
//! `batch x peak / bytes_per_step`; the achieved rate's fraction of it is the model-bandwidth
//! utilisation, `bytes_per_step x steps/s / peak`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::Error;

/// The record's file under the cargo target directory.
pub const RECORD_FILE: &str = "memwall/decode.json";

/// One measured decode run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodeRecord {
    /// The model's name (the checkpoint directory's).
    pub model: String,
    /// The backend that ran it (`cpu::Fast`).
    pub backend: String,
    /// The weights' format (`bf16`, `fp8`).
    pub dtype: String,
    /// Sequences decoded together.
    pub batch: u64,
    /// Tokens in each sequence's KV cache at the first timed step.
    pub context: u64,
    /// Decode steps timed.
    pub steps: u64,
    /// Tokens/s of the whole batch (`batch x steps / seconds`).
    pub tokens_per_s: f64,
    /// Bytes one decode step read, from the op list (`OpCost`), averaged over the timed steps.
    pub bytes_per_step: f64,
    /// FLOPs of one decode step, from the op list, averaged over the timed steps.
    pub flops_per_step: f64,
    /// The read ceiling measured in the same run (`memwall::peak`, all threads), decimal GB/s.
    pub peak_read_gb_s: f64,
    /// This machine's estimated f32 FMA peak (`memwall::peak::FlopsEstimate`), if known.
    pub estimated_peak_flops_per_s: Option<f64>,
    /// The checkpoint's `config.json`.
    pub config: serde_json::Value,
}

impl DecodeRecord {
    /// The memory wall of the run in tokens/s of the batch: `batch x peak / bytes_per_step`.
    pub fn wall_tokens_per_s(&self) -> f64 {
        self.batch as f64 * self.peak_read_gb_s * 1e9 / self.bytes_per_step
    }

    /// Achieved over the wall: bytes read per second over the measured peak.
    pub fn bandwidth_utilisation(&self) -> f64 {
        self.tokens_per_s / self.wall_tokens_per_s()
    }

    /// The one-line summary the bench prints.
    pub fn summary(&self) -> String {
        format!(
            "decode {} batch {} context {}: {:.2} tok/s = {:.1}% of the wall {:.2} tok/s at measured read peak \
             {:.1} GB/s",
            self.model,
            self.batch,
            self.context,
            self.tokens_per_s,
            100.0 * self.bandwidth_utilisation(),
            self.wall_tokens_per_s(),
            self.peak_read_gb_s
        )
    }

    /// Checks the figures are usable (finite, positive; the batch at least 1).
    pub fn check(&self) -> Result<(), Error> {
        let bad = |what: &str, v: f64| -> Result<(), Error> {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(Error::InvalidArgument {
                    what: "decode record",
                    reason: format!("{what} is {v}: must be finite and positive"),
                })
            }
        };
        bad("tokens_per_s", self.tokens_per_s)?;
        bad("bytes_per_step", self.bytes_per_step)?;
        bad("flops_per_step", self.flops_per_step)?;
        bad("peak_read_gb_s", self.peak_read_gb_s)?;
        bad("batch", self.batch as f64)?;
        if let Some(f) = self.estimated_peak_flops_per_s {
            bad("estimated_peak_flops_per_s", f)?;
        }
        Ok(())
    }

    /// Reads a record; `Ok(None)` if the file does not exist. A file of several records (one
    /// per batch) gives its first.
    pub fn load(path: &Path) -> Result<Option<DecodeRecord>, Error> {
        Ok(Self::load_all(path)?.into_iter().next())
    }

    /// Reads every record of the file (a JSON array, or one object); empty if the file does not
    /// exist. All records must be of one model (one bench run).
    pub fn load_all(path: &Path) -> Result<Vec<DecodeRecord>, Error> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(Error::Io { path: path.to_path_buf(), source }),
        };
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            Many(Vec<DecodeRecord>),
            One(Box<DecodeRecord>),
        }
        let bad = |reason: String| Error::InvalidArgument { what: "decode record", reason };
        let records =
            match serde_json::from_str(&text).map_err(|e| bad(format!("{}: {e}", path.display())))? {
                OneOrMany::Many(v) => v,
                OneOrMany::One(r) => vec![*r],
            };
        for r in &records {
            r.check()?;
            if r.model != records[0].model {
                return Err(bad(format!(
                    "{}: records of two models ({} and {}); one bench run records one model",
                    path.display(),
                    records[0].model,
                    r.model
                )));
            }
        }
        Ok(records)
    }

    /// Writes the record (creating its directory).
    pub fn save(&self, path: &Path) -> Result<(), Error> {
        Self::save_all(std::slice::from_ref(self), path)
    }

    /// Writes records as a JSON array (creating the directory).
    pub fn save_all(records: &[DecodeRecord], path: &Path) -> Result<(), Error> {
        let io = |source| Error::Io { path: path.to_path_buf(), source };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let text = serde_json::to_string_pretty(records)
            .map_err(|e| Error::InvalidArgument { what: "decode record", reason: e.to_string() })?;
        std::fs::write(path, text).map_err(io)
    }
}

/// Where the record lives: `$CARGO_TARGET_DIR/memwall/decode.json`, or `target/memwall/decode.json`
/// under the current directory (cargo runs benches from the package root).
pub fn default_path() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| PathBuf::from("target"), PathBuf::from);
    target.join(RECORD_FILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> DecodeRecord {
        DecodeRecord {
            model: "llama-shaped".into(),
            backend: "cpu::Fast".into(),
            dtype: "bf16".into(),
            batch: 1,
            context: 16,
            steps: 8,
            tokens_per_s: 4.0,
            bytes_per_step: 2e9,
            flops_per_step: 4e9,
            peak_read_gb_s: 10.0,
            estimated_peak_flops_per_s: Some(3e11),
            config: serde_json::json!({"hidden_size": 8}),
        }
    }

    #[test]
    fn wall_and_utilisation() {
        let r = sample();
        // 10 GB/s over 2 GB a step: 5 steps/s, 5 tok/s at batch 1; 4 achieved is 80%.
        assert_eq!(r.wall_tokens_per_s(), 5.0);
        assert!((r.bandwidth_utilisation() - 0.8).abs() < 1e-12);
        assert_eq!(
            r.summary(),
            "decode llama-shaped batch 1 context 16: 4.00 tok/s = 80.0% of the wall 5.00 tok/s at measured \
             read peak 10.0 GB/s"
        );
        // At batch 4 the same bytes serve four tokens.
        let b4 = DecodeRecord { batch: 4, ..sample() };
        assert_eq!(b4.wall_tokens_per_s(), 20.0);
        assert!((b4.bandwidth_utilisation() - 0.2).abs() < 1e-12);
    }

    #[test]
    fn round_trip_and_bad_records() {
        let dir = std::env::temp_dir().join(format!("memwall-record-{}", std::process::id()));
        let path = dir.join("sub/decode.json");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(matches!(DecodeRecord::load(&path), Ok(None)));
        sample().save(&path).expect("save");
        assert_eq!(DecodeRecord::load(&path).expect("load"), Some(sample()));
        std::fs::write(&path, "{").expect("write");
        assert!(matches!(DecodeRecord::load(&path), Err(Error::InvalidArgument { .. })));
        DecodeRecord { peak_read_gb_s: 0.0, ..sample() }.save(&path).expect("save");
        assert!(matches!(DecodeRecord::load(&path), Err(Error::InvalidArgument { .. })));
        // A batch sweep round-trips; a lone object (the older format) still loads.
        let sweep = vec![sample(), DecodeRecord { batch: 4, tokens_per_s: 14.0, ..sample() }];
        DecodeRecord::save_all(&sweep, &path).expect("save_all");
        assert_eq!(DecodeRecord::load_all(&path).expect("load_all"), sweep);
        std::fs::write(&path, serde_json::to_string(&sample()).expect("json")).expect("write");
        assert_eq!(DecodeRecord::load_all(&path).expect("load_all"), vec![sample()]);
        let mixed = vec![sample(), DecodeRecord { model: "other".into(), ..sample() }];
        DecodeRecord::save_all(&mixed, &path).expect("save_all");
        assert!(matches!(DecodeRecord::load_all(&path), Err(Error::InvalidArgument { .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
