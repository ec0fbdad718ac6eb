//! The queries of a scenario run: synthetic (seeded ids, lengths from a distribution) or read from
//! a JSONL file of `{"input_ids": [...], "max_new_tokens": n}`, one object per line.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// One query.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Query {
    pub input_ids: Vec<u32>,
    pub max_new_tokens: usize,
}

/// Why the queries could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum RequestsError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path} line {line}: not a query object {{\"input_ids\": [...], \"max_new_tokens\": n}}: {source}"
    )]
    Json {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path} line {line}: {reason}")]
    Invalid { path: PathBuf, line: usize, reason: String },
    #[error("{path}: no queries")]
    Empty { path: PathBuf },
    #[error("invalid length distribution `{text}`: {reason} (expected N or MIN..MAX, e.g. 8..32)")]
    Distribution { text: String, reason: String },
    #[error("invalid synthetic queries: {0}")]
    Synthetic(String),
}

/// A length drawn uniformly from `min..=max` (a fixed length when they are equal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LenDist {
    pub min: usize,
    pub max: usize,
}

impl LenDist {
    /// `N` or `MIN..MAX` (inclusive).
    pub fn parse(text: &str) -> Result<LenDist, RequestsError> {
        let bad =
            |reason: &str| RequestsError::Distribution { text: text.to_string(), reason: reason.into() };
        let num = |s: &str| s.trim().parse::<usize>().map_err(|e| bad(&e.to_string()));
        let (min, max) = match text.split_once("..") {
            Some((a, b)) => (num(a)?, num(b.trim_start_matches('='))?),
            None => {
                let n = num(text)?;
                (n, n)
            }
        };
        if min == 0 || min > max {
            return Err(bad("lengths must be at least 1 and MIN <= MAX"));
        }
        Ok(LenDist { min, max })
    }

    fn draw(&self, rng: &mut SplitMix) -> usize {
        self.min + (rng.next_u64() % (self.max - self.min + 1) as u64) as usize
    }
}

/// splitmix64: small, seeded, and the same everywhere.
#[derive(Clone, Debug)]
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1].
    pub fn open01(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
}

/// `n` queries with ids uniform below `vocab` and lengths from `input` and `output`, from `seed`.
pub fn synthetic(
    n: usize,
    input: LenDist,
    output: LenDist,
    vocab: usize,
    seed: u64,
) -> Result<Vec<Query>, RequestsError> {
    if n == 0 || vocab == 0 {
        return Err(RequestsError::Synthetic(format!("{n} queries over a vocabulary of {vocab}")));
    }
    let mut rng = SplitMix::new(seed);
    Ok((0..n)
        .map(|_| {
            let len = input.draw(&mut rng);
            let input_ids = (0..len).map(|_| (rng.next_u64() % vocab as u64) as u32).collect();
            Query { input_ids, max_new_tokens: output.draw(&mut rng) }
        })
        .collect())
}

/// Reads a JSONL file: one query per non-blank line.
pub fn read_jsonl(path: &Path) -> Result<Vec<Query>, RequestsError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| RequestsError::Io { path: path.into(), source })?;
    parse_jsonl(&text, path)
}

/// Parses JSONL text (`path` only names it in errors).
pub fn parse_jsonl(text: &str, path: &Path) -> Result<Vec<Query>, RequestsError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let q: Query = serde_json::from_str(line).map_err(|source| RequestsError::Json {
            path: path.into(),
            line: i + 1,
            source,
        })?;
        let invalid =
            |reason: &str| RequestsError::Invalid { path: path.into(), line: i + 1, reason: reason.into() };
        if q.input_ids.is_empty() {
            return Err(invalid("input_ids is empty"));
        }
        if q.max_new_tokens == 0 {
            return Err(invalid("max_new_tokens is 0"));
        }
        out.push(q);
    }
    if out.is_empty() {
        return Err(RequestsError::Empty { path: path.into() });
    }
    Ok(out)
}

/// Poisson arrivals at `rate` queries/s from `seed`: `n` times, exponential gaps, the first at 0.
pub fn poisson_arrivals(n: usize, rate: f64, seed: u64) -> Vec<f64> {
    let mut rng = SplitMix::new(seed ^ 0x5eed_a77e);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += -rng.open01().ln() / rate;
            }
            t
        })
        .collect()
}
