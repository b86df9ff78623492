//! Sampling parameters and their ranges: the one set of ranges. The shard
//! applies what passes here as it is (it checks no range of its own).

use super::error::{out_of_range, ValidationError};
use super::params::{Decoding, GenerateParameters};
use super::validate::Validation;
use crate::infer::SamplingParameters;

/// Most entries of `logit_bias` in one request (OpenAI allows 300).
pub const MAX_LOGIT_BIAS: usize = 1024;

impl Validation {
    pub(super) fn sampling(&self, p: &GenerateParameters) -> Result<SamplingParameters, ValidationError> {
        let finite = |field: &str, v: f32| {
            if v.is_finite() {
                Ok(v)
            } else {
                Err(out_of_range(field, "must be a finite number"))
            }
        };
        let temperature = match p.decoding {
            Decoding::ByTemperature => p.temperature.unwrap_or(0.0),
            Decoding::GreedyUnless { do_sample } => {
                let warped = p.temperature.is_some_and(|t| t != 1.0)
                    || p.top_k.is_some()
                    || p.top_p.is_some()
                    || p.typical_p.is_some();
                if do_sample || warped {
                    p.temperature.unwrap_or(1.0)
                } else {
                    0.0
                }
            }
        };
        let temperature = finite("temperature", temperature)?;
        if temperature < 0.0 || temperature > p.max_temperature {
            let upper = if p.max_temperature == f32::MAX {
                String::new()
            } else {
                format!(" and at most {}", p.max_temperature)
            };
            return Err(out_of_range("temperature", format!("must be at least 0{upper}")));
        }
        let top_k = match p.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k.min(i64::from(u32::MAX)) as u32,
            Some(_) => return Err(out_of_range("top_k", "must be positive, or -1 or 0 to disable")),
        };
        let top_p = finite("top_p", p.top_p.unwrap_or(1.0))?;
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(out_of_range("top_p", "must be in (0, 1]"));
        }
        let min_p = finite("min_p", p.min_p.unwrap_or(0.0))?;
        if !(0.0..=1.0).contains(&min_p) {
            return Err(out_of_range("min_p", "must be in [0, 1]"));
        }
        let typical_p = finite("typical_p", p.typical_p.unwrap_or(1.0))?;
        if !(typical_p > 0.0 && typical_p <= 1.0) {
            return Err(out_of_range("typical_p", "must be in (0, 1]"));
        }
        let repetition_penalty = finite("repetition_penalty", p.repetition_penalty.unwrap_or(1.0))?;
        if repetition_penalty <= 0.0 || repetition_penalty > 100.0 {
            return Err(out_of_range("repetition_penalty", "must be in (0, 100]"));
        }
        let penalty = |field: &str, v: Option<f32>| {
            let v = finite(field, v.unwrap_or(0.0))?;
            if (-2.0..=2.0).contains(&v) {
                Ok(v)
            } else {
                Err(out_of_range(field, "must be in [-2, 2]"))
            }
        };
        let frequency_penalty = penalty("frequency_penalty", p.frequency_penalty)?;
        let presence_penalty = penalty("presence_penalty", p.presence_penalty)?;
        if p.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(out_of_range(
                "logit_bias",
                format!("at most {MAX_LOGIT_BIAS} tokens may be biased, got {}", p.logit_bias.len()),
            ));
        }
        let mut logit_bias: Vec<(u32, f32)> = Vec::with_capacity(p.logit_bias.len());
        let mut biased = std::collections::HashSet::with_capacity(p.logit_bias.len());
        for (field, key, bias) in &p.logit_bias {
            let id: u64 = key.parse().map_err(|_| ValidationError::OutOfRange {
                field: field.clone(),
                message: format!("`{key}` is not a token id"),
            })?;
            let id = self.check_token(field, id)?;
            if !bias.is_finite() || !(-100.0..=100.0).contains(bias) {
                return Err(out_of_range(field, "bias must be in [-100, 100]"));
            }
            // "5", "05" and "+5" are one token: its bias is given once.
            if !biased.insert(id) {
                return Err(out_of_range(field, format!("token id {id} is biased more than once")));
            }
            logit_bias.push((id, *bias));
        }
        Ok(SamplingParameters {
            temperature,
            top_k,
            top_p,
            min_p,
            typical_p,
            repetition_penalty,
            frequency_penalty,
            presence_penalty,
            // Always concrete, so a preempted request resumes identically.
            seed: p.seed.unwrap_or_else(rand::random),
            logit_bias,
        })
    }
}
