//! An in-process shard for tests: it implements [`Shard`] like the real
//! client, keeps per-request state as a real shard does, and checks every
//! step the way a real shard's tensors would silently *not*:
//!
//! - ids: a `NewRequest` for an id it already holds, a `ScheduledRequest` for
//!   one it does not;
//! - block tables: ids out of range, the same block twice in one table, too
//!   few blocks to hold `num_computed_tokens + num_new_tokens` slots;
//! - writers: two requests writing one block, or a request writing a block
//!   that another live request's table lists (a shared, cached block);
//! - KV contents: every slot a request attends to must hold the KV of exactly
//!   its own token prefix. The fake "KV" of slot `s` is a hash of the token
//!   sequence up to and including the token written there, so a prefix-cache
//!   hit on the wrong block, a stale block, or a chunk boundary off by one is
//!   caught at the step that reads it.
//!
//! A violation fails the step (like a crashed shard) and is recorded, so a
//! test asserts `handle.violations().is_empty()`.
//!
//! Tokens are "generated" deterministically from the whole sequence so far,
//! so a request produces the same tokens whatever its batch, chunking,
//! cache hits, preemptions or drafts were. With `grammar` set, a constrained request
//! (`NewRequest.grammar`) picks among the tokens its llguidance matcher
//! allows, as a real shard masks them, preferring to end (EOS, then a
//! closing `"`, `}` or `]`) so outputs stay short. With `echo_probability` set, a
//! token repeats the one `echo_period` positions back that often, so output
//! repeats itself and n-gram drafts get accepted.
//!
//! LoRA adapters: `LoadAdapter` puts a path in a slot (a path containing
//! `bad` is refused as a real shard refuses a bad folder, INVALID_ARGUMENT);
//! a request's tokens and KV depend on its adapter's path (the hash starts
//! from it), so KV reused across adapters, or a request run on a slot that
//! holds another adapter, is caught. Changing a slot that a live request
//! uses, or naming an empty slot, is a violation.
//!
//! Multi-step decode (`decode_steps`) draws one token after another in one
//! step, writing each draw's input slot, and stops after a stop token; the
//! table is then cut to the computed slots, as after drafts.
//!
//! Drafts (speculative decoding) are verified as a real shard does: each
//! draft slot gets the KV of the draft's own prefix (also the rejected ones,
//! whose slots then hold KV of a sequence that did not happen: reading one
//! later is caught), drafts are accepted while they equal the generated
//! token, and the block table is cut to the blocks of the computed slots.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::client::{ClientError, Shard};
use crate::grammar::GrammarCompiler;
use crate::pb::{
    Generation, LoadAdapterRequest, LoadAdapterResponse, RequestError, SamplingParams, StepRequest, StepResponse,
    StepTimings, TokenLogprob, UnloadAdapterRequest,
};

#[derive(Debug, Clone)]
pub struct FakeShardConfig {
    pub block_size: u32,
    pub num_blocks: u32,
    pub vocab_size: u32,
    pub eos_token_id: u32,
    /// Chance that a generated token is EOS (decided by the sequence hash).
    pub eos_probability: f64,
    /// Time one step takes, plus `latency_per_token` for every token it
    /// computes (new requests' chunks, decodes and drafts).
    pub latency: Duration,
    pub latency_per_token: Duration,
    /// Honour `NewRequest.grammar` (for the model's tokenizer).
    pub grammar: Option<Arc<GrammarCompiler>>,
    /// Chance that a generated token repeats the one `echo_period` back.
    pub echo_probability: f64,
    pub echo_period: usize,
    /// Adapter slots (0: LoRA off).
    pub max_loras: u32,
    /// When not empty: every request generates these tokens, then EOS,
    /// whatever its grammar says (a model's exact output, for the parsers
    /// reading it).
    pub script: Vec<u32>,
}

impl Default for FakeShardConfig {
    fn default() -> Self {
        Self {
            block_size: 4,
            num_blocks: 64,
            vocab_size: 1000,
            eos_token_id: 0,
            eos_probability: 0.0,
            latency: Duration::ZERO,
            latency_per_token: Duration::ZERO,
            grammar: None,
            echo_probability: 0.0,
            echo_period: 8,
            max_loras: 0,
            script: Vec::new(),
        }
    }
}

#[derive(Debug, Clone)]
struct FakeRequest {
    tokens: Vec<u32>,
    num_prompt_tokens: usize,
    num_computed_tokens: usize,
    blocks: Vec<u32>,
    params: SamplingParams,
    grammar: String,
    adapter_slot: u32,
    /// Where its hashes start: its adapter's (see [`adapter_seed`]).
    seed: u64,
}

#[derive(Debug, Default)]
struct FakeState {
    requests: HashMap<u64, FakeRequest>,
    /// Per slot: hash of the token prefix whose last token's KV is there.
    kv: Vec<Option<u64>>,
    steps: Vec<StepRequest>,
    violations: Vec<String>,
    fail_steps: u32,
    fail_requests: HashSet<u64>,
    /// Steps that never answer (a stopped shard), counted down.
    hang_steps: u32,
    /// Per adapter slot (index slot - 1): the path loaded there.
    slots: Vec<Option<String>>,
    /// Every LoadAdapter / UnloadAdapter received, in order: (slot, path; "" to empty).
    adapter_calls: Vec<(u32, String)>,
    /// Paths refused from now on (as if their files were damaged).
    broken_paths: HashSet<String>,
}

pub struct FakeShard {
    config: FakeShardConfig,
    state: Arc<Mutex<FakeState>>,
}

/// Inspects and steers a [`FakeShard`] that the scheduler owns.
#[derive(Clone)]
pub struct FakeShardHandle {
    state: Arc<Mutex<FakeState>>,
}

impl FakeShard {
    pub fn new(config: FakeShardConfig) -> (Self, FakeShardHandle) {
        let state = FakeState {
            kv: vec![None; (config.num_blocks * config.block_size) as usize],
            slots: vec![None; config.max_loras as usize],
            ..Default::default()
        };
        let state = Arc::new(Mutex::new(state));
        (Self { config, state: state.clone() }, FakeShardHandle { state })
    }
}

impl FakeShardHandle {
    /// Every step received, in order.
    pub fn steps(&self) -> Vec<StepRequest> {
        self.state.lock().unwrap().steps.clone()
    }

    /// Scheduler bugs the shard caught.
    pub fn violations(&self) -> Vec<String> {
        self.state.lock().unwrap().violations.clone()
    }

    /// The next `n` steps fail as a whole (the RPC errors) without touching
    /// shard state.
    pub fn fail_next_steps(&self, n: u32) {
        self.state.lock().unwrap().fail_steps = n;
    }

    /// The next `n` steps never answer, like a shard stopped with SIGSTOP.
    pub fn hang_next_steps(&self, n: u32) {
        self.state.lock().unwrap().hang_steps = n;
    }

    /// The next step that computes request `id` answers with a
    /// `RequestError` for it.
    pub fn fail_request(&self, id: u64) {
        self.state.lock().unwrap().fail_requests.insert(id);
    }

    /// The path in each adapter slot.
    pub fn adapter_slots(&self) -> Vec<Option<String>> {
        self.state.lock().unwrap().slots.clone()
    }

    /// Every LoadAdapter (slot, path) and UnloadAdapter (slot, "") so far.
    pub fn adapter_calls(&self) -> Vec<(u32, String)> {
        self.state.lock().unwrap().adapter_calls.clone()
    }

    /// Loads of `path` fail from now on (its files were damaged on disk).
    pub fn break_adapter(&self, path: &str) {
        self.state.lock().unwrap().broken_paths.insert(path.to_string());
    }
}

/// Where the hashes of a sequence generated with the adapter loaded from
/// `path` start (`None`: the base model's).
pub fn adapter_seed(path: Option<&str>) -> u64 {
    path.map_or(HASH_SEED, |p| p.bytes().fold(HASH_SEED ^ 0x5bd1_e995, |h, b| extend_hash(h, u32::from(b))))
}

/// Rolling hash of a token prefix: `prefix_hash(h(t0..tk), tk+1)`.
fn extend_hash(h: u64, token: u32) -> u64 {
    (h ^ (token as u64 + 1)).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(17)
}

const HASH_SEED: u64 = 0xcbf2_9ce4_8422_2325;

fn prefix_hashes(seed: u64, tokens: &[u32]) -> Vec<u64> {
    let mut h = seed;
    tokens
        .iter()
        .map(|&t| {
            h = extend_hash(h, t);
            h
        })
        .collect()
}

/// The token a sequence "generates" with the base model, and its fake logprob.
pub fn next_token(config: &FakeShardConfig, tokens: &[u32], may_end: bool) -> (u32, f32) {
    next_token_from(config, HASH_SEED, tokens, may_end)
}

/// The token a sequence generates with the adapter whose [`adapter_seed`] is `seed`.
pub fn next_token_from(config: &FakeShardConfig, seed: u64, tokens: &[u32], may_end: bool) -> (u32, f32) {
    let h = prefix_hashes(seed, tokens).last().copied().unwrap_or(seed);
    let h = h.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let roll = ((h >> 40) % 1_000_000) as f64 / 1_000_000.0;
    let logprob = -(((h >> 8) % 1000) as f32) / 100.0;
    if may_end && roll < config.eos_probability {
        return (config.eos_token_id, logprob);
    }
    let echo_roll = ((h >> 4) % 1_000_000) as f64 / 1_000_000.0;
    if config.echo_period > 0 && tokens.len() >= config.echo_period && echo_roll < config.echo_probability {
        let echoed = tokens[tokens.len() - config.echo_period];
        if echoed != config.eos_token_id {
            return (echoed, logprob);
        }
    }
    let mut token = ((h >> 16) % config.vocab_size as u64) as u32;
    if token == config.eos_token_id {
        token = (token + 1) % config.vocab_size;
    }
    (token, logprob)
}

/// The token a constrained request "generates": one its grammar allows.
fn constrained_token(config: &FakeShardConfig, r: &FakeRequest, may_end: bool) -> Result<u32, String> {
    let compiler = config.grammar.as_ref().ok_or("this fake shard has no grammar support")?;
    let mut matcher = compiler.matcher(&r.grammar)?;
    matcher.consume_tokens(&r.tokens[r.num_prompt_tokens..]).map_err(|e| e.to_string())?;
    let mut allowed = matcher.compute_mask_or_eos().map_err(|e| e.to_string())?;
    let trie = compiler.tok_env().tok_trie();
    if !may_end {
        for &eos in trie.eos_tokens() {
            allowed.disallow_token(eos);
        }
    }
    let closers: Vec<u32> = ["\"", "}", "]"].iter().filter_map(|c| trie.token_id(c.as_bytes())).collect();
    let preferred = trie.eos_tokens().iter().chain(&closers).find(|&&t| allowed.is_allowed(t));
    if let Some(&token) = preferred {
        return Ok(token);
    }
    let choices = allowed.to_list();
    if choices.is_empty() {
        return Err("every token was masked".into());
    }
    let h = prefix_hashes(r.seed, &r.tokens).last().copied().unwrap_or(r.seed);
    Ok(choices[(h % choices.len() as u64) as usize])
}

/// One request's work in a step, validated.
struct Work {
    id: u64,
    start: usize,
    num_new_tokens: usize,
    draft: Vec<u32>,
    /// Multi-step decode: draws in this step, and the tokens that end them.
    decode_steps: usize,
    stop_token_ids: Vec<u32>,
}

impl FakeState {
    fn validate(&self, config: &FakeShardConfig, step: &StepRequest) -> Result<(HashMap<u64, FakeRequest>, Vec<Work>), String> {
        let bs = config.block_size as usize;
        let finished: HashSet<u64> = step.finished_ids.iter().copied().collect();
        // The shard's view after dropping finished requests and adding new ones.
        let mut live: HashMap<u64, FakeRequest> = self
            .requests
            .iter()
            .filter(|(id, _)| !finished.contains(id))
            .map(|(&id, r)| (id, r.clone()))
            .collect();
        let mut work = Vec::new();
        for new in &step.new_requests {
            if live.contains_key(&new.id) {
                return Err(format!("new request {} is already live", new.id));
            }
            let len = new.token_ids.len();
            let computed = new.num_computed_tokens as usize;
            if len == 0 || new.num_prompt_tokens == 0 || new.num_prompt_tokens as usize > len {
                return Err(format!("request {}: bad token counts", new.id));
            }
            if computed >= len {
                return Err(format!("request {}: num_computed_tokens {computed} >= {len}", new.id));
            }
            let adapter = match new.adapter_slot {
                0 => None,
                slot => match self.slots.get(slot as usize - 1) {
                    Some(Some(path)) => Some(path.as_str()),
                    _ => return Err(format!("request {}: adapter slot {slot} holds no adapter", new.id)),
                },
            };
            live.insert(
                new.id,
                FakeRequest {
                    tokens: new.token_ids.clone(),
                    num_prompt_tokens: new.num_prompt_tokens as usize,
                    num_computed_tokens: computed,
                    blocks: new.block_ids.clone(),
                    params: new.params.clone().ok_or_else(|| format!("request {}: no params", new.id))?,
                    grammar: new.grammar.clone(),
                    adapter_slot: new.adapter_slot,
                    seed: adapter_seed(adapter),
                },
            );
            work.push(Work {
                id: new.id,
                start: computed,
                num_new_tokens: new.num_new_tokens as usize,
                draft: Vec::new(),
                decode_steps: 1,
                stop_token_ids: Vec::new(),
            });
        }
        for s in &step.scheduled {
            let Some(r) = live.get_mut(&s.id) else {
                return Err(format!("scheduled request {} is unknown", s.id));
            };
            r.blocks.extend(&s.new_block_ids);
            work.push(Work {
                id: s.id,
                start: r.num_computed_tokens,
                num_new_tokens: s.num_new_tokens as usize,
                draft: s.draft_token_ids.clone(),
                decode_steps: s.decode_steps.max(1) as usize,
                stop_token_ids: s.stop_token_ids.clone(),
            });
        }
        let mut writers: HashMap<u32, u64> = HashMap::new();
        let mut seen_ids = HashSet::new();
        for w in &work {
            if !seen_ids.insert(w.id) {
                return Err(format!("request {} appears twice in one step", w.id));
            }
            let r = &live[&w.id];
            if w.num_new_tokens == 0 || w.start + w.num_new_tokens > r.tokens.len() {
                return Err(format!(
                    "request {}: computes [{}, {}) of {} tokens",
                    w.id,
                    w.start,
                    w.start + w.num_new_tokens,
                    r.tokens.len()
                ));
            }
            let mut table = HashSet::new();
            for &b in &r.blocks {
                if b >= config.num_blocks {
                    return Err(format!("request {}: block {b} out of range", w.id));
                }
                if !table.insert(b) {
                    return Err(format!("request {}: block {b} twice in its table", w.id));
                }
            }
            if !w.draft.is_empty() && w.start + w.num_new_tokens != r.tokens.len() {
                return Err(format!("request {}: a draft on a step that does not sample", w.id));
            }
            if w.decode_steps > 1 && (w.num_new_tokens != 1 || w.start + 1 != r.tokens.len() || !w.draft.is_empty()) {
                return Err(format!("request {}: decode_steps on a step that is not a plain decode", w.id));
            }
            if w.decode_steps > 1 && !r.grammar.is_empty() {
                return Err(format!("request {}: decode_steps for a constrained request", w.id));
            }
            // n draws write the KV of n positions from `start` on.
            let end = w.start + w.num_new_tokens + w.draft.len() + w.decode_steps - 1;
            if r.blocks.len() * bs < end {
                return Err(format!("request {}: {} blocks cannot hold {end} slots", w.id, r.blocks.len()));
            }
            // Attention reads slots [0, start): they must hold this prefix,
            // computed with this request's adapter.
            let hashes = prefix_hashes(r.seed, &r.tokens);
            for (pos, &hash) in hashes.iter().enumerate().take(w.start) {
                let slot = r.blocks[pos / bs] as usize * bs + pos % bs;
                if self.kv[slot] != Some(hash) {
                    return Err(format!("request {}: slot of token {pos} holds other KV", w.id));
                }
            }
            for index in w.start / bs..(end - 1) / bs + 1 {
                let block = r.blocks[index];
                if let Some(other) = writers.insert(block, w.id) {
                    if other != w.id {
                        return Err(format!("block {block} written by requests {other} and {}", w.id));
                    }
                }
            }
        }
        // A block being written must not be in any other live request's table.
        for (id, r) in &live {
            for b in &r.blocks {
                if let Some(&writer) = writers.get(b) {
                    if writer != *id {
                        return Err(format!("request {writer} writes block {b}, which request {id} holds"));
                    }
                }
            }
        }
        Ok((live, work))
    }

    // ClientError is the trait's error type, large because tonic::Status is.
    #[allow(clippy::result_large_err)]
    fn step(&mut self, config: &FakeShardConfig, step: StepRequest) -> Result<StepResponse, ClientError> {
        self.steps.push(step.clone());
        if self.fail_steps > 0 {
            self.fail_steps -= 1;
            return Err(ClientError::Status(tonic::Status::unavailable("injected step failure")));
        }
        let (live, work) = match self.validate(config, &step) {
            Ok(v) => v,
            Err(violation) => {
                self.violations.push(violation.clone());
                return Err(ClientError::Status(tonic::Status::internal(violation)));
            }
        };
        self.requests = live;
        let bs = config.block_size as usize;
        let mut response = StepResponse { timings: Some(StepTimings::default()), ..Default::default() };
        for w in work {
            if self.fail_requests.remove(&w.id) {
                self.requests.remove(&w.id);
                response.errors.push(RequestError { id: w.id, message: "injected request failure".into() });
                continue;
            }
            let r = self.requests.get_mut(&w.id).expect("validated");
            // KV of the own tokens, then of every draft (rejected ones too).
            let sequence: Vec<u32> = r.tokens.iter().chain(&w.draft).copied().collect();
            let hashes = prefix_hashes(r.seed, &sequence);
            for (pos, &hash) in hashes.iter().enumerate().skip(w.start).take(w.num_new_tokens + w.draft.len()) {
                self.kv[r.blocks[pos / bs] as usize * bs + pos % bs] = Some(hash);
            }
            r.num_computed_tokens = w.start + w.num_new_tokens;
            if r.num_computed_tokens < r.tokens.len() {
                continue; // a prefill chunk: nothing sampled
            }
            let first = r.tokens.len() == r.num_prompt_tokens;
            let prompt_logprobs = if r.params.prompt_logprobs && first {
                (1..r.tokens.len())
                    .map(|i| TokenLogprob {
                        token_id: r.tokens[i],
                        logprob: next_token_from(config, r.seed, &r.tokens[..i], false).1,
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let emitted = match verify(config, r, &w.draft) {
                Ok(mut emitted) if w.decode_steps > 1 => {
                    // Further draws, each from the token drawn before.
                    while emitted.len() < w.decode_steps && !w.stop_token_ids.contains(r.tokens.last().expect("drawn")) {
                        let pos = r.tokens.len() - 1;
                        let hash = *prefix_hashes(r.seed, &r.tokens).last().expect("tokens");
                        self.kv[r.blocks[pos / bs] as usize * bs + pos % bs] = Some(hash);
                        r.num_computed_tokens = pos + 1;
                        emitted.extend(verify(config, r, &[]).expect("an unconstrained draw"));
                    }
                    r.blocks.truncate(r.num_computed_tokens.div_ceil(bs));
                    emitted
                }
                Ok(emitted) => emitted,
                Err(message) => {
                    self.requests.remove(&w.id);
                    response.errors.push(RequestError { id: w.id, message });
                    continue;
                }
            };
            if !w.draft.is_empty() {
                r.num_computed_tokens += emitted.len() - 1;
                r.blocks.truncate(r.num_computed_tokens.div_ceil(bs));
            }
            for (i, (token_id, logprob)) in emitted.into_iter().enumerate() {
                response.generations.push(Generation {
                    id: w.id,
                    token_id,
                    logprob,
                    top_tokens: Vec::new(),
                    prompt_logprobs: if i == 0 { prompt_logprobs.clone() } else { Vec::new() },
                });
            }
        }
        Ok(response)
    }
}

/// Appends to `r` the tokens a step with `draft` emits: the drafts that
/// equal what the sequence generates, then one generated token. A
/// constrained request's tokens come from its grammar.
fn verify(config: &FakeShardConfig, r: &mut FakeRequest, draft: &[u32]) -> Result<Vec<(u32, f32)>, String> {
    let mut emitted = Vec::new();
    for i in 0..=draft.len() {
        let generated = r.tokens.len() - r.num_prompt_tokens;
        let may_end = generated >= r.params.min_tokens as usize;
        let (token_id, logprob) = if !config.script.is_empty() {
            (config.script.get(generated).copied().unwrap_or(config.eos_token_id), -0.5)
        } else if r.grammar.is_empty() {
            next_token_from(config, r.seed, &r.tokens, may_end)
        } else {
            (constrained_token(config, r, may_end)?, next_token_from(config, r.seed, &r.tokens, may_end).1)
        };
        r.tokens.push(token_id);
        emitted.push((token_id, logprob));
        if i == draft.len() || token_id != draft[i] {
            break;
        }
    }
    Ok(emitted)
}

impl FakeState {
    /// Drops `finished` requests, then checks that no live one uses `slot`.
    // tonic::Status is the gRPC handlers' error type, large as it is.
    #[allow(clippy::result_large_err)]
    fn claim_slot(&mut self, config: &FakeShardConfig, slot: u32, finished: &[u64]) -> Result<(), tonic::Status> {
        for id in finished {
            self.requests.remove(id);
        }
        if slot == 0 || slot > config.max_loras {
            return Err(tonic::Status::invalid_argument(format!("adapter slot {slot} is not in [1, {}]", config.max_loras)));
        }
        if let Some((id, _)) = self.requests.iter().find(|(_, r)| r.adapter_slot == slot) {
            let violation = format!("adapter slot {slot} changed under live request {id}");
            self.violations.push(violation.clone());
            return Err(tonic::Status::failed_precondition(violation));
        }
        Ok(())
    }

    // ClientError is the trait's error type, large because tonic::Status is.
    #[allow(clippy::result_large_err)]
    fn load_adapter(&mut self, config: &FakeShardConfig, request: LoadAdapterRequest) -> Result<LoadAdapterResponse, ClientError> {
        self.adapter_calls.push((request.slot, request.path.clone()));
        for id in &request.finished_ids {
            self.requests.remove(id);
        }
        if request.slot > 0 {
            self.claim_slot(config, request.slot, &request.finished_ids)?;
            self.slots[request.slot as usize - 1] = None;
        }
        if request.path.contains("bad") || self.broken_paths.contains(&request.path) {
            return Err(ClientError::Status(tonic::Status::invalid_argument(format!("{} is not a PEFT folder", request.path))));
        }
        if request.slot > 0 {
            self.slots[request.slot as usize - 1] = Some(request.path);
        }
        Ok(LoadAdapterResponse { rank: 8, target_modules: vec!["q_proj".into(), "v_proj".into()] })
    }

    #[allow(clippy::result_large_err)]
    fn unload_adapter(&mut self, config: &FakeShardConfig, request: UnloadAdapterRequest) -> Result<(), ClientError> {
        self.adapter_calls.push((request.slot, String::new()));
        self.claim_slot(config, request.slot, &request.finished_ids)?;
        self.slots[request.slot as usize - 1] = None;
        Ok(())
    }
}

impl Shard for FakeShard {
    fn step(&mut self, request: StepRequest) -> impl Future<Output = Result<StepResponse, ClientError>> + Send {
        let state = self.state.clone();
        let config = self.config.clone();
        async move {
            let tokens: u32 = request.new_requests.iter().map(|r| r.num_new_tokens).sum::<u32>()
                + request.scheduled.iter().map(|s| s.num_new_tokens + s.draft_token_ids.len() as u32).sum::<u32>();
            let latency = config.latency + config.latency_per_token * tokens;
            if !latency.is_zero() {
                tokio::time::sleep(latency).await;
            }
            let hang = {
                let mut state = state.lock().unwrap();
                let hang = state.hang_steps > 0;
                state.hang_steps = state.hang_steps.saturating_sub(1);
                hang
            };
            if hang {
                std::future::pending::<()>().await;
            }
            let mut state = state.lock().unwrap();
            state.step(&config, request)
        }
    }

    fn load_adapter(
        &mut self,
        request: LoadAdapterRequest,
    ) -> impl Future<Output = Result<LoadAdapterResponse, ClientError>> + Send {
        let result = self.state.lock().unwrap().load_adapter(&self.config, request);
        async move { result }
    }

    fn unload_adapter(&mut self, request: UnloadAdapterRequest) -> impl Future<Output = Result<(), ClientError>> + Send {
        let result = self.state.lock().unwrap().unload_adapter(&self.config, request);
        async move { result }
    }
}
