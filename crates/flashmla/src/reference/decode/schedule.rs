//! The split-KV schedule of decode (docs/spec.md section 4): which SM part processes which chunk of which request's
//! keys. A pure function of the shapes, the SM count and the per-request key counts (`cache_seqlens` or
//! `topk_length` values), so a GPU computes the same schedule on the device with no host synchronisation;
//! this is the host version, used by the reference and by tests.

/// Query rows one CTA processes at once: one warpgroup's wgmma M tile (64 rows of `s_q * h_q / h_kv`).
pub const ROWS_PER_CTA: usize = 64;
/// Keys per tile, the unit of work and of chunk boundaries: one 64-token page, one KV pipeline stage
/// (64 x 576 bf16 = 72 KB).
pub const KEYS_PER_TILE: usize = 64;
/// Fixed cost of one chunk, in key tiles: loading its Q tile (64 x 576 bf16, about one KV tile), writing the
/// f32 partial (64 x 512 x 4 B, about two tiles of traffic, but contiguous) and reading it back in the combine.
pub const CHUNK_OVERHEAD_TILES: usize = 4;
/// Most parts the balanced schedule splits one request over: the budget is at least `ceil(segment / 32)` units for
/// the longest request's segment. Each part of a split request writes a 64 x 512 f32 partial per row tile and the
/// combine reads them all, so a lone long request cut into one part per SM pays more in partials than it gains in
/// parallel tiles (H100, b 1, s_k 4K: 48.6 -> 34.5 us at h_q 64, 31.9 -> 25.2 at h_q 16 with 33 parts instead of
/// 132; b 1, h_q 128, s_k 16K: 68.0 -> 54.5 with 33 instead of 66).
pub const MAX_REQUEST_PARTS: usize = 32;
/// The most units the [`MAX_REQUEST_PARTS`] floor asks of a part: once a part holds this many (16 units, about 768
/// keys beyond its overhead), more parallel tiles pay for their partials, and the floor stops binding. It matters
/// where one request is much longer than the rest of a full batch (one request of 131072 keys among 127 of 1024:
/// the floor of 65 units left 61 of 132 parts idle at h_q 16 and 64) and for a lone request of more than about 32K
/// keys.
pub const MAX_BUDGET_FLOOR: usize = 16;

/// The tile sizes and costs the heuristic assumes (the GPU kernel's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleConfig {
    /// Query rows per CTA ([`ROWS_PER_CTA`]).
    pub rows_per_cta: usize,
    /// Keys per tile ([`KEYS_PER_TILE`]).
    pub keys_per_tile: usize,
    /// Cost of one chunk beyond its tiles, in tiles ([`CHUNK_OVERHEAD_TILES`]; at least 1 is used).
    pub chunk_overhead_tiles: usize,
    /// Most parts one request is split over ([`MAX_REQUEST_PARTS`]; 0: no bound) ...
    pub max_request_parts: usize,
    /// ... while its parts hold at most this many units ([`MAX_BUDGET_FLOOR`]; 0: always).
    pub max_budget_floor: usize,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig {
            rows_per_cta: ROWS_PER_CTA,
            keys_per_tile: KEYS_PER_TILE,
            chunk_overhead_tiles: CHUNK_OVERHEAD_TILES,
            max_request_parts: MAX_REQUEST_PARTS,
            max_budget_floor: MAX_BUDGET_FLOOR,
        }
    }
}

/// The shapes the schedule depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleShape {
    /// Query tokens per request.
    pub s_q: usize,
    /// Query heads.
    pub h_q: usize,
    /// Key heads (1 for MLA and for sparse decode).
    pub h_kv: usize,
    /// Streaming multiprocessors of the device (132 on an H100 SXM).
    pub num_sms: usize,
}

/// One chunk: keys `start..end` of request `request`, processed by SM part `part`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvChunk {
    /// The request (batch index).
    pub request: usize,
    /// The SM part (a persistent CTA column of the grid) that processes it.
    pub part: usize,
    /// First key position.
    pub start: usize,
    /// One past the last key position (`start == end` only for a request without keys).
    pub end: usize,
}

/// A split-KV schedule. `chunks` is sorted by request and by part at once (both are non-decreasing), so the
/// chunks of request `b` are `chunks[request_chunks[b]..request_chunks[b + 1]]` and those of part `p` are
/// `chunks[part_chunks[p]..part_chunks[p + 1]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeSchedule {
    /// Parts the grid has per head tile: `max(1, num_sms / head_tiles)`.
    pub num_parts: usize,
    /// CTAs one chunk needs to cover every head: `h_kv * ceil(s_q * h_q / h_kv / rows_per_cta)`.
    pub head_tiles: usize,
    /// The work each part is given, in tiles (see [`decode_schedule`]).
    pub tile_budget: usize,
    /// The chunks, in order.
    pub chunks: Vec<KvChunk>,
    /// `b + 1` offsets into `chunks`, per request.
    pub request_chunks: Vec<usize>,
    /// `num_parts + 1` offsets into `chunks`, per part.
    pub part_chunks: Vec<usize>,
}

impl DecodeSchedule {
    /// An upper bound on the number of chunks for `batch` requests: `batch + num_parts - 1`. It depends on
    /// shapes only, so a GPU can size its partial-result buffers without reading the key counts.
    pub fn max_chunks(batch: usize, num_parts: usize) -> usize {
        (batch + num_parts).saturating_sub(1).max(batch)
    }

    /// The work of part `p` in tiles: its chunks' tiles plus one chunk overhead per chunk.
    pub fn part_cost(&self, p: usize, config: &ScheduleConfig) -> usize {
        let kpt = config.keys_per_tile.max(1);
        let overhead = config.chunk_overhead_tiles.max(1);
        self.chunks[self.part_chunks[p]..self.part_chunks[p + 1]]
            .iter()
            .map(|c| overhead + (c.end - c.start).div_ceil(kpt))
            .sum()
    }
}

/// The balanced budget before [`aligned_budget`]: `ceil(line / num_parts)`, but at least the floor
/// `min(ceil(longest / max_request_parts), max_budget_floor)` (see [`decode_schedule`]); `line` and `longest` (the
/// longest segment) in line units.
pub fn balanced_budget(
    line: usize,
    longest: usize,
    num_parts: usize,
    config: &ScheduleConfig,
) -> usize {
    let floor = match (config.max_request_parts, config.max_budget_floor) {
        (0, _) => 1,
        (m, 0) => longest.div_ceil(m).max(1),
        (m, cap) => longest.div_ceil(m).min(cap).max(1),
    };
    line.div_ceil(num_parts.max(1)).max(floor)
}

/// The budget of a uniform batch, rounded up to whole requests when that costs at most 1/16 more per part: no
/// request is then split, so no partials are written and the combine has nothing to do. Any other batch keeps
/// `budget`. (b 128 requests of 4096 keys on 66 parts: 132 -> 136 units, two whole requests per part.)
pub fn aligned_budget(budget: usize, tiles: &[usize], overhead: usize) -> usize {
    let Some(&t0) = tiles.first() else {
        return budget;
    };
    if tiles.iter().any(|&t| t != t0) {
        return budget;
    }
    let seg = overhead + t0;
    let aligned = budget.div_ceil(seg) * seg;
    if (aligned - budget) * 16 <= budget {
        aligned
    } else {
        budget
    }
}

/// Splits every request's keys into chunks so that the work fills the SMs.
///
/// The heuristic ("cut the work line"):
/// 1. One chunk needs `head_tiles = h_kv * ceil(s_q * (h_q / h_kv) / rows_per_cta)` CTAs to cover all query
///    rows, so the grid is `head_tiles x num_parts` CTAs with `num_parts = max(1, num_sms / head_tiles)`.
/// 2. Request `b` costs `overhead + tiles_b` units, `tiles_b = ceil(num_keys[b] / keys_per_tile)`. Lay the
///    requests on a line in order, each as its overhead followed by its tiles: request `b` starts at
///    `S_b = sum_{c < b} (overhead + tiles_c)` and its tile `k` sits at `S_b + overhead + k`. The line has
///    length `L = S_batch`.
/// 3. Cut the line into pieces of `budget = max(ceil(L / num_parts), floor)` units, `floor =
///    min(ceil(max_b segment_b / max_request_parts), max_budget_floor)` (`aligned_budget` may round it up to whole
///    requests for a uniform batch): tile `k` of request `b` goes to part `(S_b + overhead + k) / budget`; a
///    request's consecutive tiles in one part form a chunk.
///    A request without keys gets one empty chunk in the part of its last overhead unit,
///    `(S_b + overhead - 1) / budget`.
///
/// Guarantees (tested): every key is in exactly one chunk; every part index is `< num_parts` (the line ends
/// before `num_parts * budget`); at most `batch + num_parts - 1` chunks (each cut splits at most one
/// request); every part's cost (its tiles plus one overhead per chunk) is at most `budget + overhead`, as
/// only a part's first chunk can have its overhead before the part's piece of the line.
///
/// On a GPU: one thread per request computes `tiles_b`, a block-wide prefix sum gives `S_b` and `L`, and each
/// request's chunk count `last_part - first_part + 1` (a second prefix sum places them) — a single small
/// kernel with no host round trip, so the whole decode step can be captured in a CUDA graph.
///
/// Worked example (the test `schedule_worked_example` checks it): `s_q = 1`, `h_q = 128`, `h_kv = 1`,
/// `num_sms = 16`, default config (64 rows, 64 keys per tile, overhead 4), `num_keys = [4096, 100, 0, 1000]`.
/// `head_tiles = ceil(128 / 64) = 2`, `num_parts = 16 / 2 = 8`; `tiles = [64, 2, 0, 16]`, costs
/// `[68, 6, 4, 20]`, `L = 98`, `budget = ceil(98 / 8) = 13`.
/// * request 0 (`S = 0`): tiles at 4..=67 -> parts 0 (tiles 0..9, keys 0..576), 1 (9..22, 576..1408),
///   2 (22..35), 3 (35..48), 4 (48..61), 5 (61..64, keys 3904..4096): six chunks;
/// * request 1 (`S = 68`): tiles at 72, 73 -> part 5, keys 0..100;
/// * request 2 (`S = 74`, no keys): empty chunk in part `77 / 13 = 5`;
/// * request 3 (`S = 78`): tiles at 82..=97 -> parts 6 (keys 0..576) and 7 (576..1000).
///
/// Ten chunks (bound 4 + 8 - 1 = 11); part costs 13, 17, 17, 17, 17, 17, 13, 11 (bound 13 + 4 = 17).
pub fn decode_schedule(
    shape: &ScheduleShape,
    config: &ScheduleConfig,
    num_keys: &[usize],
) -> DecodeSchedule {
    let keys_per_tile = config.keys_per_tile.max(1);
    let overhead = config.chunk_overhead_tiles.max(1);
    let h_kv = shape.h_kv.max(1);
    let rows = (shape.s_q * (shape.h_q / h_kv)).max(1);
    let head_tiles = h_kv * rows.div_ceil(config.rows_per_cta.max(1));
    let num_parts = (shape.num_sms / head_tiles).max(1);

    let tiles: Vec<usize> = num_keys
        .iter()
        .map(|&n| n.div_ceil(keys_per_tile))
        .collect();
    let line: usize = tiles.iter().map(|&t| overhead + t).sum();
    let longest = tiles.iter().map(|&t| overhead + t).max().unwrap_or(0);
    let budget = aligned_budget(
        balanced_budget(line, longest, num_parts, config),
        &tiles,
        overhead,
    );

    let mut chunks = Vec::with_capacity(DecodeSchedule::max_chunks(num_keys.len(), num_parts));
    let mut request_chunks = Vec::with_capacity(num_keys.len() + 1);
    request_chunks.push(0);
    let mut start = 0usize; // S_b
    for (request, (&n, &t)) in num_keys.iter().zip(&tiles).enumerate() {
        let first = start + overhead; // line position of tile 0
        if t == 0 {
            let part = (first - 1) / budget;
            chunks.push(KvChunk {
                request,
                part,
                start: 0,
                end: 0,
            });
        }
        let mut k = 0;
        while k < t {
            let part = (first + k) / budget;
            // First tile of this request that lies in the next part's piece of the line.
            let next = ((part + 1) * budget - first).min(t);
            chunks.push(KvChunk {
                request,
                part,
                start: k * keys_per_tile,
                end: (next * keys_per_tile).min(n),
            });
            k = next;
        }
        start = first + t;
        request_chunks.push(chunks.len());
    }

    let mut part_chunks = vec![0usize; num_parts + 1];
    for c in &chunks {
        part_chunks[c.part + 1] += 1;
    }
    for p in 0..num_parts {
        part_chunks[p + 1] += part_chunks[p];
    }
    DecodeSchedule {
        num_parts,
        head_tiles,
        tile_budget: budget,
        chunks,
        request_chunks,
        part_chunks,
    }
}
