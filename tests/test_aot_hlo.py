"""The optimized-HLO readers of trainer/aot_hlo.py on small hand-written TPU modules: collectives
per execution, and the HBM bytes of one loop iteration and of the code around it."""

from trainer import aot_hlo


def test_collectives_are_counted_per_execution():
  hlo = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%cond (p: (s32[])) -> pred[] {
  %i = s32[] get-tuple-element((s32[]) %p), index=0
  %n = s32[]{:T(128)} constant(4)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

%body (p: (s32[])) -> (s32[]) {
  %ag = bf16[8,128]{1,0:T(8,128)(2,1)} all-gather(bf16[2,128]{1,0} %w), dimensions={0}
  ROOT %t = (s32[]) tuple(s32[] %i)
}

ENTRY %main (a: f32[4]) -> f32[8] {
  %ar = (f32[4]{0}, f32[16]{0}) all-reduce(f32[4]{0} %a, f32[16]{0} %b), to_apply=%add
  %s = (bf16[2,4]{1,0}, bf16[8,4]{1,0}) all-gather-start(bf16[2,4]{1,0} %q)
  %d = bf16[8,4]{1,0} all-gather-done(%s)
  %w = (s32[]) while((s32[]) %t), condition=%cond, body=%body
  ROOT %m = f32[8]{0} multiply(f32[8]{0} %x, f32[8]{0} %y)
}
"""
  # the loop body's all-gather runs 4 times (XLA's cost analysis would count it once)
  assert aot_hlo.collectives(hlo) == {"all-gather": {"count": 5, "bytes": 4 * 8 * 128 * 2 + 8 * 4 * 2},
                                  "all-reduce": {"count": 1, "bytes": (4 + 16) * 4}}
  # a ragged all-to-all (operands printed untyped) counts its smaller buffer: the 256 rows sent
  # into a 1024-row receive buffer (room for every device's rows), then 256 rows back
  ragged = """HloModule r

ENTRY %main (a: f32[256,128]) -> f32[256,128] {
  %send = f32[256,128]{1,0} bitcast(f32[256,128]{1,0} %a)
  %recv = f32[1024,128]{1,0} ragged-all-to-all(%send, %buf, %o, %s, %p, %r), replica_groups={{0,1,2,3}}
  ROOT %back = f32[256,128]{1,0} ragged-all-to-all(%recv, %send, %o, %s, %p, %r), replica_groups={{0,1,2,3}}
}
"""
  assert aot_hlo.collectives(ragged) == {"ragged-all-to-all": {"count": 2, "bytes": 2 * 256 * 128 * 4}}


# A decode-like module: a data-dependent loop whose body prefetches a weight into VMEM
# (S(1)), looks up 4 rows of an HBM table, multiplies in VMEM, writes its result to HBM and
# calls a Mosaic kernel that declares its bytes; around the loop, an fp32 weight cast to bf16
# and a row written in place.
DECODE = """HloModule decode

%fused_rows (param_0: bf16[1024,128], param_1: s32[]) -> bf16[4,128] {
  %param_0 = bf16[1024,128]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = s32[]{:T(128)} parameter(1)
  %zero = s32[]{:T(128)} constant(0)
  ROOT %rows = bf16[4,128]{1,0:T(4,128)(2,1)} dynamic-slice(%param_0, %param_1, %zero), dynamic_slice_sizes={4,128}
}

%fused_dot (param_0: bf16[4,128], param_1: bf16[128,256]) -> f32[4,256] {
  %param_0 = bf16[4,128]{1,0:T(4,128)(2,1)S(1)} parameter(0)
  %param_1 = bf16[128,256]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  ROOT %dot = f32[4,256]{1,0:T(4,128)} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_put (param_0: bf16[64,128], param_1: bf16[1,128], param_2: s32[]) -> bf16[64,128] {
  %param_0 = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = bf16[1,128]{1,0:T(2,128)(2,1)} parameter(1)
  %param_2 = s32[]{:T(128)} parameter(2)
  %zero = s32[]{:T(128)} constant(0)
  ROOT %put = bf16[64,128]{1,0:T(8,128)(2,1)} dynamic-update-slice(%param_0, %param_1, %param_2, %zero)
}

%cond (p: (s32[], bf16[128,256], bf16[1024,128], s32[])) -> pred[] {
  %p = (s32[]{:T(128)}, bf16[128,256]{1,0:T(8,128)(2,1)}, bf16[1024,128]{1,0:T(8,128)(2,1)}, s32[]{:T(128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} get-tuple-element(%p), index=3
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

%body (p: (s32[], bf16[128,256], bf16[1024,128], s32[])) -> (s32[], bf16[128,256], bf16[1024,128], s32[]) {
  %p = (s32[]{:T(128)}, bf16[128,256]{1,0:T(8,128)(2,1)}, bf16[1024,128]{1,0:T(8,128)(2,1)}, s32[]{:T(128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %w = bf16[128,256]{1,0:T(8,128)(2,1)} get-tuple-element(%p), index=1
  %table = bf16[1024,128]{1,0:T(8,128)(2,1)} get-tuple-element(%p), index=2
  %n = s32[]{:T(128)} get-tuple-element(%p), index=3
  %prefetch = (bf16[128,256]{1,0:T(8,128)(2,1)S(1)}, bf16[128,256]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%w)
  %w_vmem = bf16[128,256]{1,0:T(8,128)(2,1)S(1)} copy-done(%prefetch)
  %x = bf16[4,128]{1,0:T(4,128)(2,1)S(1)} fusion(%table, %i), kind=kLoop, calls=%fused_rows
  %y = f32[4,256]{1,0:T(4,128)} fusion(%x, %w_vmem), kind=kOutput, calls=%fused_dot
  %k = f32[4,256]{1,0:T(4,128)} custom-call(%y, %table, %table), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"TUzv","cost_estimate":{"flops":"8","transcendentals":"0","bytes_accessed":"5000","remote_bytes_transferred":"0"}}}
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  ROOT %t = (s32[]{:T(128)}, bf16[128,256]{1,0:T(8,128)(2,1)}, bf16[1024,128]{1,0:T(8,128)(2,1)}, s32[]{:T(128)}) tuple(%next, %w, %table, %n)
}

ENTRY %main (head: f32[128,256], table: bf16[1024,128], cache: bf16[64,128], row: bf16[1,128], n: s32[]) -> bf16[64,128] {
  %head = f32[128,256]{1,0:T(8,128)} parameter(0)
  %table = bf16[1024,128]{1,0:T(8,128)(2,1)} parameter(1)
  %cache = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(2)
  %row = bf16[1,128]{1,0:T(2,128)(2,1)} parameter(3)
  %n = s32[]{:T(128)} parameter(4)
  %head_bf16 = bf16[128,256]{1,0:T(8,128)(2,1)} convert(%head)
  %zero = s32[]{:T(128)} constant(0)
  %init = (s32[]{:T(128)}, bf16[128,256]{1,0:T(8,128)(2,1)}, bf16[1024,128]{1,0:T(8,128)(2,1)}, s32[]{:T(128)}) tuple(%zero, %head_bf16, %table, %n)
  %loop = (s32[]{:T(128)}, bf16[128,256]{1,0:T(8,128)(2,1)}, bf16[1024,128]{1,0:T(8,128)(2,1)}, s32[]{:T(128)}) while(%init), condition=%cond, body=%body
  ROOT %updated = bf16[64,128]{1,0:T(8,128)(2,1)} fusion(%cache, %row, %zero), kind=kLoop, calls=%fused_put
}
"""


def test_hbm_bytes_count_what_crosses_hbm_per_iteration_and_per_call():
  hbm = aot_hlo.hbm_bytes(DECODE)
  weight, rows, result = 128 * 256 * 2, 4 * 128 * 2, 4 * 256 * 4
  # per iteration: the weight read once by its prefetch (its VMEM copy and the matmul's VMEM
  # reads are on chip), the 4 looked-up rows (not the table), the result written, the
  # kernel's declared bytes (not its operands); scalars: the lookup's index, the condition's
  # compare (two s32 read, a pred written) and the counter's add
  assert hbm["loop"] == weight + rows + result + 5000 + 4 + (8 + 1) + 12
  # around the loop: the fp32 weight read and its bf16 copy written; the row read and written
  # in place (not the cache)
  assert hbm["outside"] == 128 * 256 * (4 + 2) + 2 * 128 * 2 + 4
  # XLA's count would add the VMEM copy and its reads, the table and the kernel's operands


def test_hbm_bytes_of_a_module_without_a_loop():
  module = """HloModule m

ENTRY %main (a: f32[256]) -> f32[256] {
  %a = f32[256]{0:T(256)} parameter(0)
  %b = f32[256]{0:T(256)S(1)} negate(%a)
  ROOT %c = f32[256]{0:T(256)} exponential(%b)
}
"""
  assert aot_hlo.hbm_bytes(module) == {"loop": 0.0, "outside": 256 * 4 + 256 * 4}


# XLA's bidirectional windowed einsum: a loop counting 0, 2 (u32) to 4 whose body reads two
# 16-row chunks of a [64, 128] weight per fusion, through pads and a nested fusion.
WINDOWED = """HloModule windowed

%fused_chunks (param_0: s32[], param_1: bf16[1,64,128]) -> bf16[2,16,128] {
  %param_1 = bf16[1,64,128]{2,1,0:T(8,128)(2,1)} parameter(1)
  %inf = bf16[]{:T(256)} constant(-inf)
  %low = bf16[2,64,128]{2,1,0:T(8,128)(2,1)} pad(%param_1, %inf), padding=0_1x0_0x0_0
  %high = bf16[2,64,128]{2,1,0:T(8,128)(2,1)} pad(%param_1, %inf), padding=1_0x0_0x0_0
  %param_0 = s32[]{:T(128)S(6)} parameter(0)
  %zero = s32[]{:T(128)S(6)} constant(0)
  %a = bf16[2,16,128]{2,1,0:T(8,128)(2,1)} dynamic-slice(%low, %zero, %param_0, %zero), dynamic_slice_sizes={2,16,128}
  %b = bf16[2,16,128]{2,1,0:T(8,128)(2,1)} dynamic-slice(%high, %zero, %param_0, %zero), dynamic_slice_sizes={2,16,128}
  ROOT %m = bf16[2,16,128]{2,1,0:T(8,128)(2,1)} maximum(%a, %b)
}

%fused_dot (param_0: s32[], param_1: bf16[1,64,128], param_2: bf16[2,16]) -> f32[128] {
  %param_0 = s32[]{:T(128)S(6)} parameter(0)
  %param_1 = bf16[1,64,128]{2,1,0:T(8,128)(2,1)} parameter(1)
  %param_2 = bf16[2,16]{1,0:T(2,128)(2,1)S(1)} parameter(2)
  %chunks = bf16[2,16,128]{2,1,0:T(8,128)(2,1)} fusion(%param_0, %param_1), kind=kLoop, calls=%fused_chunks
  ROOT %dot = f32[128]{0:T(128)S(1)} dot(%param_2, %chunks), lhs_contracting_dims={0,1}, rhs_contracting_dims={0,1}
}

%cond (p: (u32[], bf16[1,64,128], bf16[2,16])) -> pred[] {
  %p = (u32[]{:T(128)S(2)}, bf16[1,64,128]{2,1,0:T(8,128)(2,1)}, bf16[2,16]{1,0:T(2,128)(2,1)S(1)}) parameter(0)
  %i = u32[]{:T(128)S(2)} get-tuple-element(%p), index=0
  %n = u32[]{:T(128)S(2)} constant(4)
  ROOT %lt = pred[]{:T(512)S(2)} compare(%i, %n), direction=LT
}

%body (p: (u32[], bf16[1,64,128], bf16[2,16])) -> (u32[], bf16[1,64,128], bf16[2,16]) {
  %p = (u32[]{:T(128)S(2)}, bf16[1,64,128]{2,1,0:T(8,128)(2,1)}, bf16[2,16]{1,0:T(2,128)(2,1)S(1)}) parameter(0)
  %i = u32[]{:T(128)S(2)} get-tuple-element(%p), index=0
  %w = bf16[1,64,128]{2,1,0:T(8,128)(2,1)} get-tuple-element(%p), index=1
  %x = bf16[2,16]{1,0:T(2,128)(2,1)S(1)} get-tuple-element(%p), index=2
  %offset = s32[]{:T(128)S(6)} bitcast(%i)
  %y = f32[128]{0:T(128)S(1)} fusion(%offset, %w, %x), kind=kOutput, calls=%fused_dot
  %two = u32[]{:T(128)S(2)} constant(2)
  %next = u32[]{:T(128)S(2)} add(%i, %two)
  ROOT %t = (u32[]{:T(128)S(2)}, bf16[1,64,128]{2,1,0:T(8,128)(2,1)}, bf16[2,16]{1,0:T(2,128)(2,1)S(1)}) tuple(%next, %w, %x)
}

ENTRY %main (w: bf16[1,64,128], x: bf16[2,16]) -> f32[128] {
  %w = bf16[1,64,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %x = bf16[2,16]{1,0:T(2,128)(2,1)S(1)} parameter(1)
  %zero = u32[]{:T(128)S(2)} constant(0)
  %init = (u32[]{:T(128)S(2)}, bf16[1,64,128]{2,1,0:T(8,128)(2,1)}, bf16[2,16]{1,0:T(2,128)(2,1)S(1)}) tuple(%zero, %w, %x)
  %loop = (u32[]{:T(128)S(2)}, bf16[1,64,128]{2,1,0:T(8,128)(2,1)}, bf16[2,16]{1,0:T(2,128)(2,1)S(1)}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[128]{0:T(128)} copy(%x)
}
"""


def test_windowed_einsum_loops_step_by_their_increment_and_read_their_chunks():
  comps, entry = aot_hlo._computations(WINDOWED)
  assert aot_hlo._multipliers(comps, entry)["body"] == 2  # 0, 2: two trips, not four
  # per trip, the fusion reads two 16-row chunks of the weight (one per pad; the pads'
  # -inf rows are not read), not the weight whole: the two trips read it once
  chunk = 16 * 128 * 2
  assert aot_hlo.hbm_bytes(WINDOWED)["loop"] == 2 * chunk
