//! The weight matmuls of the forward pass: Q8_0 weights times Q8_0-quantized activations.
//!
//! The arithmetic is exactly candle's AVX2 Q8_0 dot product (and llama.cpp's): per block of 32,
//! the integer dot product of the signed bytes in eight lanes of four, converted to f32 and
//! fused-multiply-added with the product of the two block scales into eight lane accumulators,
//! which are then summed in one fixed order. What differs is the cost around it. candle
//! converted both f16 block scales with a function call per block of every dot product (a sixth
//! of a decode step) and used other kernels (VNNI tiles, with other sums) for some shapes on
//! some CPUs. Here weight scales are f32 from load on, a pass takes four weight rows by two
//! input rows (each block of either loaded once for the others), and one kernel serves every
//! shape.
//!
//! Every output value is computed by the same sequence of operations whatever the batch, the
//! row split over threads, or the CPU: the AVX2 path and the portable one give the same bits
//! (`tests::the_portable_kernel_gives_the_avx2_bits`), so engines on different machines can
//! exchange K/V and still agree on every token.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};

use candle_core::Device;
use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

use super::LlamaError;

/// Values per Q8_0 block.
const BLOCK: usize = 32;
/// Bytes of one Q8_0 block in a GGUF tensor: an f16 scale, then 32 signed bytes.
const BLOCK_BYTES: usize = 2 + BLOCK;
/// Weight rows one pass of the kernel reads together (they share each input block's load).
const ROW_GROUP: usize = 4;
/// Input rows one pass of the kernel reads together (they share each weight block's load).
const INPUT_GROUP: usize = 2;

/// Rows of `k` values in Q8_0: `k / 32` blocks per row, each 32 signed bytes and a scale (kept
/// as f32: exact, since a Q8_0 scale is an f16).
#[derive(Debug)]
pub(super) struct Q8Rows {
    rows: usize,
    k: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
}

impl Q8Rows {
    /// A GGUF weight (`rows × k`), requantized to Q8_0 from any other type first.
    pub(super) fn from_weight(t: QTensor) -> Result<Q8Rows, LlamaError> {
        let (rows, k) = t.shape().dims2()?;
        if !k.is_multiple_of(BLOCK) {
            return Err(LlamaError::Unsupported {
                what: format!("a weight of {rows} × {k}"),
                reason: format!("rows must be whole blocks of {BLOCK}"),
            });
        }
        let t = if t.dtype() == GgmlDType::Q8_0 {
            t
        } else {
            QTensor::quantize(&t.dequantize(&Device::Cpu)?, GgmlDType::Q8_0)?
        };
        let data: Cow<'_, [u8]> = t.data()?;
        let blocks = rows * k / BLOCK;
        if data.len() != blocks * BLOCK_BYTES {
            return Err(LlamaError::Unsupported {
                what: format!("a Q8_0 weight of {rows} × {k}"),
                reason: format!("{} bytes for {blocks} blocks", data.len()),
            });
        }
        let mut qs = Vec::with_capacity(rows * k);
        let mut d = Vec::with_capacity(blocks);
        for block in data.chunks_exact(BLOCK_BYTES) {
            d.push(f16::from_le_bytes([block[0], block[1]]).to_f32());
            qs.extend(block[2..].iter().map(|&b| b as i8));
        }
        Ok(Q8Rows { rows, k, qs, d })
    }

    /// `x` (`n` rows of `k`) quantized as llama.cpp quantizes activations for a Q8_0 dot
    /// product: per block, scale `max|x| / 127` rounded to f16, values rounded to nearest.
    fn quantize(x: &[f32], k: usize) -> Q8Rows {
        let blocks = x.len() / BLOCK;
        let mut qs = Vec::with_capacity(x.len());
        let mut d = Vec::with_capacity(blocks);
        for block in x.chunks_exact(BLOCK) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / 127.0;
            let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            d.push(f16::from_f32(scale).to_f32());
            qs.extend(block.iter().map(|&v| round_to_byte(v * inverse)));
        }
        Q8Rows {
            rows: x.len() / k,
            k,
            qs,
            d,
        }
    }

    fn blocks_per_row(&self) -> usize {
        self.k / BLOCK
    }

    fn row(&self, r: usize) -> (&[i8], &[f32]) {
        let b = self.blocks_per_row();
        (
            &self.qs[r * self.k..(r + 1) * self.k],
            &self.d[r * b..(r + 1) * b],
        )
    }

    /// `x (n × k) · selfᵀ`: `n` rows of `self.rows` values, split over candle's matmul
    /// threads by groups of weight rows (each output value is computed whole on one thread).
    pub(super) fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        debug_assert_eq!(x.len(), n * self.k);
        let x = Q8Rows::quantize(x, self.k);
        let out_width = self.rows;
        // Each value is written once, by the worker that owns its weight row: relaxed stores
        // (plain ones on x86), and the pool's barrier orders them before the read below.
        let out: Vec<AtomicU32> = (0..n * out_width).map(|_| AtomicU32::new(0)).collect();
        let groups = self.rows.div_ceil(ROW_GROUP);
        let kernel = Kernel::detect();
        candle_core::utils::barrier_pool().execute_chunked(groups, |range| {
            for group in range {
                let first = group * ROW_GROUP;
                let last = (first + ROW_GROUP).min(self.rows);
                for i in (0..n).step_by(INPUT_GROUP) {
                    let inputs = i..(i + INPUT_GROUP).min(n);
                    let mut sums = [[0f32; ROW_GROUP]; INPUT_GROUP];
                    kernel.dot_rows(self, first..last, &x, inputs.clone(), &mut sums);
                    for (i, sums) in inputs.zip(&sums) {
                        for (j, sum) in sums[..last - first].iter().enumerate() {
                            out[i * out_width + first + j].store(sum.to_bits(), Ordering::Relaxed);
                        }
                    }
                }
            }
        });
        out.into_iter()
            .map(|v| f32::from_bits(v.into_inner()))
            .collect()
    }
}

/// `y.round() as i8` (halves away from zero, saturating) for `|y| < 2²³`, without `roundf`,
/// which the baseline x86_64 target calls as a function for every activation value: the
/// truncation and the remainder are exact at this size, so the result is the same.
fn round_to_byte(y: f32) -> i8 {
    let t = y as i32;
    let rest = y - t as f32;
    (t + i32::from(rest >= 0.5) - i32::from(rest <= -0.5)).clamp(-128, 127) as i8
}

/// Asks the CPU to start loading `data[at..at + len]` into its caches: a hint, which touches
/// nothing past `data`'s end.
pub(super) fn prefetch<T>(data: &[T], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (at..at + len).step_by(64 / size_of::<T>().max(1)) {
        avx2::prefetch(data.as_ptr().wrapping_add(line).cast());
    }
    // Elsewhere a hint the engine does without.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, at, len);
}

/// Which implementation of the (one) arithmetic runs here.
#[derive(Debug, Clone, Copy)]
enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Kernel {
    fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Kernel::Avx2;
        }
        Kernel::Portable
    }

    /// The dot products of weight rows `rows` (at most [`ROW_GROUP`]) with rows `inputs` (at
    /// most [`INPUT_GROUP`]) of `x`: `sums[input][row]`.
    fn dot_rows(
        self,
        w: &Q8Rows,
        rows: Range<usize>,
        x: &Q8Rows,
        inputs: Range<usize>,
        sums: &mut Sums,
    ) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => avx2::dot_rows(w, rows, x, inputs, sums),
            Kernel::Portable => {
                for (i, sums) in inputs.zip(sums.iter_mut()) {
                    for (r, sum) in rows.clone().zip(sums.iter_mut()) {
                        *sum = portable_dot(w.row(r), x.row(i));
                    }
                }
            }
        }
    }
}

/// The AVX2 arithmetic, lane for lane: lane `j` of a block sums the products of bytes
/// `4j..4j+4` exactly (integers), then accumulates `scale_w × scale_x × that` with one fused
/// multiply-add; the eight lanes are summed as `hsum` does.
fn portable_dot((wq, wd): (&[i8], &[f32]), (xq, xd): (&[i8], &[f32])) -> f32 {
    let mut acc = [0f32; 8];
    for (b, (&dw, &dx)) in wd.iter().zip(xd).enumerate() {
        let d = dw * dx;
        let wb = &wq[b * BLOCK..(b + 1) * BLOCK];
        let xb = &xq[b * BLOCK..(b + 1) * BLOCK];
        for (lane, acc) in acc.iter_mut().enumerate() {
            let q: i32 = (4 * lane..4 * lane + 4)
                .map(|j| i32::from(wb[j]) * i32::from(xb[j]))
                .sum();
            *acc = d.mul_add(q as f32, *acc);
        }
    }
    hsum(acc)
}

/// Dot products of a group of weight rows with a group of input rows: `[input][row]`.
type Sums = [[f32; ROW_GROUP]; INPUT_GROUP];

/// `_mm256` lanes summed in the order of candle's `hsum_float_8`.
fn hsum(a: [f32; 8]) -> f32 {
    let r = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// The one place the engine uses `unsafe`: loading 32 bytes into a SIMD register takes a raw
/// pointer, and a `target_feature` function may only be called where the feature is known.
#[cfg(target_arch = "x86_64")]
#[allow(
    unsafe_code,
    reason = "SIMD loads take raw pointers; checked bounds and features"
)]
mod avx2 {
    use std::arch::x86_64::*;

    use std::ops::Range;

    use super::{BLOCK, INPUT_GROUP, Q8Rows, ROW_GROUP, Sums};

    /// How far ahead of the block being multiplied its weight row's bytes are prefetched (a
    /// hint: past the matrix's end it touches nothing). A matrix's rows lie one after the
    /// other, so this reaches into the next groups' rows: the hardware prefetcher alone left a
    /// decode step waiting on memory for most of its weight loads (measured: 37 → 52–60 tok/s
    /// for one sequence on one thread, 116 → 142–151 at batch 8; 512 bytes gave less, 1–8 KiB
    /// about the same).
    const PREFETCH: usize = 4096;

    /// Eight i32 lanes (as f32), lane `j` the exact sum of products of bytes `4j..4j+4` of a
    /// weight block `w` and an input block `x`, given `abs_w = |w|` (made once per weight block,
    /// however many inputs it meets): `maddubs` needs an unsigned operand, so `|w|` times `x`
    /// signed as `w`; no i16 pair can saturate, since Q8_0 bytes are in `-127..=127`.
    #[inline(always)]
    unsafe fn block_dot(abs_w: __m256i, w: __m256i, x: __m256i) -> __m256 {
        unsafe {
            let pairs = _mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(x, w));
            _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), pairs))
        }
    }

    /// See [`super::prefetch`].
    #[inline(always)]
    pub(super) fn prefetch(p: *const i8) {
        // SAFETY: a prefetch reads nothing a program can see and faults on no address; SSE is
        // part of every x86_64 CPU.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p) }
    }

    #[inline(always)]
    unsafe fn hsum(x: __m256) -> f32 {
        unsafe {
            let res = _mm256_extractf128_ps(x, 1);
            let res = _mm_add_ps(res, _mm256_castps256_ps128(x));
            let res = _mm_add_ps(res, _mm_movehl_ps(res, res));
            let res = _mm_add_ss(res, _mm_movehdup_ps(res));
            _mm_cvtss_f32(res)
        }
    }

    /// [`dot`] for a CPU whose AVX2 and FMA [`super::Kernel::detect`] found.
    pub(super) fn dot_rows(
        w: &Q8Rows,
        rows: Range<usize>,
        x: &Q8Rows,
        inputs: Range<usize>,
        sums: &mut Sums,
    ) {
        assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
        // SAFETY: the features were just checked (a cached lookup).
        unsafe { dot(w, rows, x, inputs, sums) }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot(
        w: &Q8Rows,
        rows: Range<usize>,
        x: &Q8Rows,
        inputs: Range<usize>,
        sums: &mut Sums,
    ) {
        if rows.len() == ROW_GROUP {
            let r = rows.start;
            let rows = [w.row(r), w.row(r + 1), w.row(r + 2), w.row(r + 3)];
            if inputs.len() == INPUT_GROUP {
                let i = inputs.start;
                // SAFETY: the caller's features; rows and inputs hold the same whole blocks.
                *sums = unsafe { dot4x2(rows, [x.row(i), x.row(i + 1)]) };
            } else {
                for (i, sums) in inputs.zip(sums.iter_mut()) {
                    // SAFETY: as above.
                    *sums = unsafe { dot4(rows, x.row(i)) };
                }
            }
        } else {
            for (i, sums) in inputs.zip(sums.iter_mut()) {
                for (sum, r) in sums.iter_mut().zip(rows.clone()) {
                    // SAFETY: as above.
                    *sum = unsafe { dot1(w.row(r), x.row(i)) };
                }
            }
        }
    }

    /// Four weight rows against two input rows: each weight block is loaded (and made
    /// unsigned) once for both inputs, each input block once for the four rows. Every
    /// (row, input) pair gets the same operations, in the same order, as in [`dot1`].
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot4x2(
        rows: [(&[i8], &[f32]); ROW_GROUP],
        inputs: [(&[i8], &[f32]); INPUT_GROUP],
    ) -> Sums {
        let [(x0q, x0d), (x1q, x1d)] = inputs;
        let blocks = x0d.len();
        for (q, d) in rows.into_iter().chain(inputs) {
            assert!(q.len() == blocks * BLOCK && d.len() == blocks);
        }
        let mut acc = [[_mm256_setzero_ps(); ROW_GROUP]; INPUT_GROUP];
        for b in 0..blocks {
            let at = b * BLOCK;
            // SAFETY: block `b` is in bounds of every row and input (asserted above).
            unsafe {
                let x0 = _mm256_loadu_si256(x0q.as_ptr().add(at).cast());
                let x1 = _mm256_loadu_si256(x1q.as_ptr().add(at).cast());
                let (dx0, dx1) = (*x0d.get_unchecked(b), *x1d.get_unchecked(b));
                for j in 0..ROW_GROUP {
                    let (wq, wd) = rows[j];
                    prefetch(wq.as_ptr().wrapping_add(at + PREFETCH).cast());
                    let wv = _mm256_loadu_si256(wq.as_ptr().add(at).cast());
                    let aw = _mm256_sign_epi8(wv, wv);
                    let dw = *wd.get_unchecked(b);
                    let q0 = block_dot(aw, wv, x0);
                    acc[0][j] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx0), q0, acc[0][j]);
                    let q1 = block_dot(aw, wv, x1);
                    acc[1][j] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx1), q1, acc[1][j]);
                }
            }
        }
        // SAFETY: the caller's features.
        acc.map(|row| row.map(|a| unsafe { hsum(a) }))
    }

    /// One weight row: the same operations, in the same order, as each row of [`dot4`].
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot1((wq, wd): (&[i8], &[f32]), (xq, xd): (&[i8], &[f32])) -> f32 {
        assert!(wq.len() == xq.len() && wd.len() == xd.len() && xq.len() == xd.len() * BLOCK);
        let mut acc = _mm256_setzero_ps();
        for (b, (&dw, &dx)) in wd.iter().zip(xd).enumerate() {
            // SAFETY: block `b` is in bounds of both rows (asserted above).
            unsafe {
                let xv = _mm256_loadu_si256(xq.as_ptr().add(b * BLOCK).cast());
                let wv = _mm256_loadu_si256(wq.as_ptr().add(b * BLOCK).cast());
                let q = block_dot(_mm256_sign_epi8(wv, wv), wv, xv);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), q, acc);
            }
        }
        // SAFETY: the caller's features.
        unsafe { hsum(acc) }
    }

    /// Four weight rows against one input row: each input block is loaded once, and the four
    /// accumulators' chains of multiply-adds run side by side.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot4(rows: [(&[i8], &[f32]); ROW_GROUP], (xq, xd): (&[i8], &[f32])) -> [f32; 4] {
        let blocks = xd.len();
        for (wq, wd) in rows {
            assert!(wq.len() == xq.len() && wd.len() == blocks && xq.len() == blocks * BLOCK);
        }
        let mut acc = [_mm256_setzero_ps(); ROW_GROUP];
        for b in 0..blocks {
            let at = b * BLOCK;
            // SAFETY: block `b` is in bounds of every row (asserted above).
            unsafe {
                let xv = _mm256_loadu_si256(xq.as_ptr().add(at).cast());
                let dx = *xd.get_unchecked(b);
                for (acc, (wq, wd)) in acc.iter_mut().zip(rows) {
                    prefetch(wq.as_ptr().wrapping_add(at + PREFETCH).cast());
                    let wv = _mm256_loadu_si256(wq.as_ptr().add(at).cast());
                    let q = block_dot(_mm256_sign_epi8(wv, wv), wv, xv);
                    *acc = _mm256_fmadd_ps(_mm256_set1_ps(*wd.get_unchecked(b) * dx), q, *acc);
                }
            }
        }
        // SAFETY: the caller's features.
        acc.map(|a| unsafe { hsum(a) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, k: usize, seed: u32) -> Vec<f32> {
        (0..n * k)
            .map(|i| {
                let h = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                (h % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn weight(rows_: usize, k: usize) -> Q8Rows {
        let t = candle_core::Tensor::from_vec(rows(rows_, k, 7), (rows_, k), &Device::Cpu)
            .expect("tensor");
        Q8Rows::from_weight(QTensor::quantize(&t, GgmlDType::Q8_0).expect("quantize"))
            .expect("weight")
    }

    /// Where candle runs its AVX2 Q8_0 dot product (input widths that are no multiple of
    /// 256, where it would use VNNI tiles on CPUs that have them), the bits are candle's.
    #[test]
    fn gives_candles_bits() {
        let (n, k, m) = (3, 576, 37);
        let w = weight(m, k);
        let x = rows(n, k, 99);
        let t = candle_core::Tensor::from_vec(rows(m, k, 7), (m, k), &Device::Cpu).unwrap();
        let qm = candle_core::quantized::QMatMul::from_qtensor(
            QTensor::quantize(&t, GgmlDType::Q8_0).unwrap(),
        )
        .unwrap();
        let xt = candle_core::Tensor::from_vec(x.clone(), (n, k), &Device::Cpu).unwrap();
        let theirs: Vec<f32> = candle_core::Module::forward(&qm, &xt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let ours = w.matmul(&x, n);
        let exact = cfg!(target_arch = "x86_64") && !matches!(Kernel::detect(), Kernel::Portable);
        if exact {
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ours), bits(&theirs));
        } else {
            for (a, b) in ours.iter().zip(&theirs) {
                assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{a} vs {b}");
            }
        }
    }

    /// One value does not depend on the rows beside it: a row alone, in a batch, and every
    /// row group boundary give the same bits.
    #[test]
    fn every_value_is_the_same_whatever_the_batch() {
        let (k, m) = (64, 10);
        let w = weight(m, k);
        let x = rows(5, k, 3);
        let batch = w.matmul(&x, 5);
        for i in 0..5 {
            let alone = w.matmul(&x[i * k..(i + 1) * k], 1);
            assert_eq!(alone, batch[i * m..(i + 1) * m]);
        }
    }

    #[test]
    fn activations_round_as_f32_round_does() {
        let halves = (-255..=255).map(|h| h as f32 / 2.0);
        let near = (-1000..=1000).map(|i| i as f32 * 0.127_3);
        let edges = [
            0.499_999_97,
            -0.499_999_97,
            126.5,
            -126.5,
            127.49,
            f32::NAN,
            -0.0,
        ];
        for y in halves.chain(near).chain(edges) {
            assert_eq!(round_to_byte(y), y.round() as i8, "{y}");
        }
    }

    #[test]
    fn the_portable_kernel_gives_the_avx2_bits() {
        let (k, m) = (576, 10);
        let w = weight(m, k);
        let x = Q8Rows::quantize(&rows(3, k, 5), k);
        // Whole groups and partial ones, of weight rows and of input rows.
        for (rows, inputs) in [(4..8, 0..2), (4..8, 2..3), (8..10, 0..2), (8..10, 1..2)] {
            let mut fast = [[0f32; ROW_GROUP]; INPUT_GROUP];
            let mut portable = [[0f32; ROW_GROUP]; INPUT_GROUP];
            Kernel::detect().dot_rows(&w, rows.clone(), &x, inputs.clone(), &mut fast);
            Kernel::Portable.dot_rows(&w, rows, &x, inputs, &mut portable);
            assert_eq!(
                fast.map(|r| r.map(f32::to_bits)),
                portable.map(|r| r.map(f32::to_bits))
            );
        }
    }
}
