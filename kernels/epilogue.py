"""What a generated conv kernel can do to its outputs before it stores them: add the bias, add a
residual tensor, then apply an activation. A network's conv -> BatchNorm -> (add) -> activation
chains fold into one kernel this way (maco.layouts.fusion), so they cost no extra pass over memory."""
from __future__ import annotations

from maco.core.errors import MacoError

# relu6 = hardtanh(0, 6), MobileNetV2's; silu EfficientNet's; hardswish MobileNetV3's; gelu (erf,
# torch's default) ConvNeXt's
ACTIVATIONS = ("none", "relu", "relu6", "silu", "hardswish", "gelu")
SMOOTH = ("silu", "hardswish", "gelu")  # computed by the C functions below (the others inline, per kernel)

# exp(x), Cephes' expf: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial in r, and 2^n added
# to the exponent bits. x is clamped to [-87, 88] first (2^n stays a normal float), and x > 88
# gives inf afterwards, so silu(-inf) = -inf / inf = NaN, as torch's x / (1 + exp(-x)); past -87,
# 1 + exp(x) rounds to 1 either way. A NaN fails both clamps, and the callers keep it.
def _exp_lines(j: str, vector: bool) -> list[str]:
    """C statements that set e{j} = exp(x{j}) (x{j} a float, or a maco_vf with `zero` in scope);
    every local carries the suffix j, so that several can be interleaved (maco_vact4)."""
    F = "maco_vf" if vector else "float"
    if vector:
        head = [f"const maco_vu big{j} = (maco_vu)(x{j} > zero + 88.f);",
                f"x{j} = maco_vmin(zero + 88.f, x{j}); x{j} = maco_vmax(zero - 87.f, x{j});"]
    else:
        head = [f"const int big{j} = x{j} > 88.f;", f"x{j} = x{j} > 88.f ? 88.f : x{j}; x{j} = x{j} < -87.f ? -87.f : x{j};"]
    steps = [f"{F} f{j} = x{j} * 1.44269504088896341f + 12582912.f;",  # 1.5 * 2^23: f's low bits hold round(x / ln2)
             f"{F} n{j} = f{j} - 12582912.f;",
             f"{F} r{j} = x{j} - n{j} * 0.693359375f + n{j} * 2.12194440e-4f;",
             f"{F} p{j} = r{j} * 1.9875691500e-4f + 1.3981999507e-3f;", f"p{j} = p{j} * r{j} + 8.3334519073e-3f;",
             f"p{j} = p{j} * r{j} + 4.1665795894e-2f;", f"p{j} = p{j} * r{j} + 1.6666665459e-1f;",
             f"p{j} = p{j} * r{j} + 5.0000001201e-1f;", f"p{j} = p{j} * r{j} * r{j} + r{j} + 1.f;"]
    if vector:
        tail = [f"p{j} = (maco_vf)((maco_vu)p{j} + (((maco_vu)f{j} - 0x4B400000u) << 23));",
                f"const maco_vf e{j} = maco_sel(big{j}, zero + __builtin_inff(), p{j});"]
    else:
        tail = [f"unsigned pb{j}, fb{j};", f"__builtin_memcpy(&pb{j}, &p{j}, 4); __builtin_memcpy(&fb{j}, &f{j}, 4);",
                f"pb{j} += (fb{j} - 0x4B400000u) << 23;", f"__builtin_memcpy(&p{j}, &pb{j}, 4);",
                f"const float e{j} = big{j} ? __builtin_inff() : p{j};"]
    return head + steps + tail


# gelu(v) = v / 2 * (1 + erf(v / sqrt 2)) with z = |v| / sqrt 2: 1 + erf is erfc(z) for v < 0 (no
# cancellation) and 2 - erfc(z) above. erfc(z) = t exp(-z^2) R(t), t = 1 / (1 + z / 2), R a degree-8
# polynomial fitted to erfc(z) / (t exp(-z^2)) on z in [0, 10] (least squares in relative error, 1.9e-7
# at most; Numerical Recipes' erfcc has the same form with exp(-z^2 + Q(t))): exp(-z^2) does not wait
# for the polynomial, so the two chains overlap. gelu(+inf) = inf and gelu(-inf) = -inf * 0 = NaN, as
# in torch.
_ERFC_R = (0.2820769246, 0.2825660295, 0.2415228631, 0.2097619536, -0.045383764, 0.3083559347, -0.516409526,
           0.3000201548, -0.0625107641)


def _horner(coefficients: tuple[float, ...], x: str) -> str:
    """C of the polynomial sum(c_i x^i) in Horner's form."""
    text = f"{coefficients[-1]!r}f"
    for c in reversed(coefficients[:-1]):
        text = f"({c!r}f + {x} * {text})"
    return text


def _act_lines(activation: str, j: str, vector: bool) -> list[str]:
    """C statements that set y{j} = activation(v{j}), as torch computes it (see _exp_lines)."""
    F = "maco_vf" if vector else "float"

    def sel(cond: str, a: str, b: str) -> str:
        return f"maco_sel((maco_vu)({cond}), {a}, {b})" if vector else f"({cond} ? {a} : {b})"
    zero = "zero" if vector else "0.f"
    if activation == "hardswish":  # v * min(max(v + 3, 0), 6) / 6; a NaN v makes the product NaN
        six = "zero + 6.f" if vector else "6.f"
        return [f"{F} c{j} = v{j} + 3.f;", f"c{j} = {sel(f'c{j} > {zero}', f'c{j}', zero)};",
                f"c{j} = {sel(f'c{j} < {six}', f'c{j}', six)};", f"const {F} y{j} = v{j} * c{j} / 6.f;"]
    if activation == "silu":
        return [f"{F} x{j} = -v{j};", *_exp_lines(j, vector), f"const {F} y{j} = v{j} / (1.f + e{j});"]
    if activation == "gelu":
        return [f"const {F} z{j} = {sel(f'v{j} < {zero}', f'-v{j}', f'v{j}')} * 0.70710678118654752f;",
                f"const {F} t{j} = 1.f / (1.f + 0.5f * z{j});",
                f"{F} x{j} = -z{j} * z{j};", *_exp_lines(j, vector),
                f"const {F} c{j} = t{j} * {_horner(_ERFC_R, f't{j}')} * e{j};",
                f"const {F} y{j} = 0.5f * v{j} * {sel(f'v{j} < {zero}', f'c{j}', f'2.f - c{j}')};"]
    raise MacoError(f"no C function for activation {activation!r}; it has one for {', '.join(SMOOTH)}")


def scalar_expression(activation: str) -> str:
    """C for `activation` of the float `v` (maco_act(v), from scalar_function, for a SMOOTH one); a
    NaN fails relu's tests and passes, as in torch."""
    return {"none": "v", "relu": "(v < 0.f ? 0.f : v)", "relu6": "(v < 0.f ? 0.f : (v > 6.f ? 6.f : v))"}.get(
        activation, "maco_act(v)")


def vector_expression(activation: str) -> str:
    """C for `activation` of the GCC vector `v` of type vf, in kernels that define vmax, vmin, zero
    and six (maco_vact, from vector_function, for a SMOOTH one): vmax(zero, v) and vmin(six, v)
    hand back v where a compare with a NaN fails, so NaN stays NaN, as in torch."""
    return {"none": "v", "relu": "vmax(zero, v)", "relu6": "vmin(six, vmax(zero, v))"}.get(
        activation, "(vf)maco_vact((maco_vf)v)")


def vector_type(lanes: int) -> str:
    """C of the GCC vector type vf (and vi) of `lanes` floats at any 4-byte alignment, its load ld and
    store st, and vmax / vmin (_min_max): vmax(zero, v) and vmin(six, v) keep a NaN v."""
    return (f"typedef float vf __attribute__((vector_size({4 * lanes}), aligned(4)));\n"
            f"typedef int vi __attribute__((vector_size({4 * lanes}), aligned(4)));\n"
            "static inline vf ld(const float *p) { return *(const vf *)p; }\n"  # 4-byte aligned: vmovups
            "static inline void st(float *p, vf v) { *(vf *)p = v; }\n" + _min_max(lanes, "vf", "vi", ""))


def _min_max(lanes: int, vf: str, vi: str, prefix: str) -> str:
    """C of {prefix}vmax / {prefix}vmin on the vector type `vf` (`vi` its integer twin) with x86's
    semantics, (a > b ? a : b) and (a < b ? a : b): a NaN in either hands back b, so a clamp
    vmin(six, v) or exp's vmin(88, t) keeps a NaN. One instruction where the vector is an
    SSE/AVX/AVX-512 register, a compare and select elsewhere."""
    intrinsic = {4: ("__SSE__", "_mm_max_ps", "_mm_min_ps", "__m128"),
                 8: ("__AVX__", "_mm256_max_ps", "_mm256_min_ps", "__m256"),
                 16: ("__AVX512F__", "_mm512_max_ps", "_mm512_min_ps", "__m512")}.get(lanes)
    generic = "".join(f"static inline {vf} {prefix}{name}({vf} a, {vf} b) {{ {vi} m = ({vi})(a {op} b); "
                      f"return ({vf})((({vi})a & m) | (({vi})b & ~m)); }}\n" for name, op in (("vmax", ">"), ("vmin", "<")))
    if intrinsic is None:
        return generic
    macro, vmax, vmin, reg = intrinsic
    return (f"#if defined({macro}) && defined(__x86_64__)\n#include <immintrin.h>\n"
            f"static inline {vf} {prefix}vmax({vf} a, {vf} b) {{ return ({vf}){vmax}(({reg})a, ({reg})b); }}\n"
            f"static inline {vf} {prefix}vmin({vf} a, {vf} b) {{ return ({vf}){vmin}(({reg})a, ({reg})b); }}\n"
            f"#else\n{generic}#endif\n")


def _check_smooth(activation: str) -> None:
    if activation not in SMOOTH:
        raise MacoError(f"no C function for activation {activation!r}; it has one for {', '.join(SMOOTH)}")


def scalar_function(activation: str) -> str:
    """C `static inline float maco_act(float v)` for a SMOOTH activation, as torch computes it, and
    `maco_exp(float x)`, the exp it uses (squeeze-excitation's sigmoid gate calls it too)."""
    _check_smooth(activation)
    exp = "\n".join("  " + line for line in _exp_lines("", vector=False))
    body = "\n".join("  " + line for line in _act_lines(activation, "", vector=False))
    return (f"static inline __attribute__((unused)) float maco_exp(float x) {{\n{exp}\n  return e;\n}}\n"
            f"static inline float maco_act(float v) {{\n{body}\n  return y;\n}}")


VACT_WAYS = 4  # vectors maco_vact4 interleaves


def vector_function(activation: str, lanes: int) -> str:
    """C `static inline maco_vf maco_vact(maco_vf v)` on GCC vectors of `lanes` floats (the same
    type as __m256 / __m512 at 8 / 16: cast those to maco_vf) for a SMOOTH activation, and
    `maco_vact4(maco_vf *a0, ..., maco_vf *a3)` in place on four: its statements interleaved, so
    that the four long dependency chains (exp's and erfc's polynomials) overlap where one after
    another would leave the core waiting on each. Defines maco_vf and maco_vu first."""
    _check_smooth(activation)
    head = (f"typedef float maco_vf __attribute__((vector_size({4 * lanes})));\n"
            f"typedef unsigned maco_vu __attribute__((vector_size({4 * lanes})));\n"
            "static inline maco_vf maco_sel(maco_vu m, maco_vf a, maco_vf b) "
            "{ return (maco_vf)(((maco_vu)a & m) | ((maco_vu)b & ~m)); }\n" + _min_max(lanes, "maco_vf", "maco_vu", "maco_"))
    one = "\n".join("  " + line for line in _act_lines(activation, "", vector=True))
    ways = [_act_lines(activation, str(j), vector=True) for j in range(VACT_WAYS)]
    interleaved = "\n".join("  " + line for step in zip(*ways) for line in step)
    args = ", ".join(f"maco_vf *a{j}" for j in range(VACT_WAYS))
    loads = " ".join(f"const maco_vf v{j} = *a{j};" for j in range(VACT_WAYS))
    stores = " ".join(f"*a{j} = y{j};" for j in range(VACT_WAYS))
    return head + f"""static inline maco_vf maco_vact(maco_vf v) {{
  const maco_vf zero = {{0}}; (void)zero;
{one}
  return y;
}}
static inline __attribute__((unused)) void maco_vact4({args}) {{
  const maco_vf zero = {{0}}; (void)zero;
  {loads}
{interleaved}
  {stores}
}}"""


def activation_of(relu: bool = False, activation: str | None = None) -> str:
    """The activation a caller asked for: `activation` by name, or relu=True as a shorthand."""
    if activation is None:
        return "relu" if relu else "none"
    if activation not in ACTIVATIONS:
        raise MacoError(f"unknown activation {activation!r}; kernels fuse {', '.join(ACTIVATIONS)}")
    if relu and activation != "relu":
        raise MacoError(f"relu=True contradicts activation={activation!r}")
    return activation


def torch_activation(activation: str, y):
    """`activation` applied to the tensor y by torch (the reference the C above matches). GELU in
    float64: torch 2.13's AVX-512 float32 kernel gives gelu(+inf) = NaN in whole and partial
    vectors (tensors of 5 or more), where its scalar path, its AVX2 kernel and float64 give +inf,
    the value the C above computes."""
    from torch.nn import functional as F

    return {"none": lambda t: t, "relu": F.relu, "relu6": lambda t: F.hardtanh(t, 0.0, 6.0),
            "silu": F.silu, "hardswish": F.hardswish,
            "gelu": lambda t: F.gelu(t.double()).to(t.dtype)}[activation](y)
