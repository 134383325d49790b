"""What a generated conv kernel can do to its outputs before it stores them: add the bias, add a
residual tensor, then apply an activation. A network's conv -> BatchNorm -> (add) -> activation
chains fold into one kernel this way (maco.layouts.fusion), so they cost no extra pass over memory."""
from __future__ import annotations

from maco.core.errors import MacoError

# relu6 = hardtanh(0, 6), MobileNetV2's; silu EfficientNet's; hardswish MobileNetV3's; gelu (erf,
# torch's default) ConvNeXt's
ACTIVATIONS = ("none", "relu", "relu6", "silu", "hardswish", "gelu")
SMOOTH = ("silu", "hardswish", "gelu")  # computed by the C functions below (the others inline, per kernel)

# exp(t), Cephes' expf: t = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial in r, and 2^n added
# to the exponent bits. t is clamped to [-87, 88] first (2^n stays a normal float), and t > 88
# gives inf afterwards, so silu(-inf) = -inf / inf = NaN, as torch's x / (1 + exp(-x)); past -87,
# 1 + exp(t) rounds to 1 either way. A NaN fails both clamps, and the callers keep it.
_EXP_STEPS = """  t = {sel_hi}; t = {sel_lo};
  {F} f = t * 1.44269504088896341f + 12582912.f;  /* 1.5 * 2^23: f's low bits hold round(t / ln2) */
  {F} n = f - 12582912.f;
  {F} r = t - n * 0.693359375f + n * 2.12194440e-4f;
  {F} p = r * 1.9875691500e-4f + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;"""
# gelu(v) = v / 2 * (1 + erf(v / sqrt 2)), with erfc(z) = t exp(-z^2 + poly(t)), t = 1 / (1 + z / 2)
# (Numerical Recipes' erfcc: relative error < 1.2e-7 for z >= 0), z = |v| / sqrt 2: 1 + erf is
# erfc(z) for v < 0 (no cancellation) and 2 - erfc(z) above. gelu(+inf) = inf and gelu(-inf) =
# -inf * 0 = NaN, as in torch.
_ERFC = ("t * {exp}(-z * z - 1.26551223f + t * (1.00002368f + t * (0.37409196f + t * (0.09678418f + t * ("
         "-0.18628806f + t * (0.27886807f + t * (-1.13520398f + t * (1.48851587f + t * (-0.82215223f + "
         "t * 0.17087277f)))))))))")
_ACT_BODY = {
    "silu": "  return v / (1.f + {exp}(-v));",
    "gelu": ("  const {F} z = {abs_v} * 0.70710678118654752f;\n  const {F} t = 1.f / (1.f + 0.5f * z);\n"
             "  const {F} c = " + _ERFC + ";\n  return 0.5f * v * {c_or_2_minus_c};"),
}


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
    """C `static inline float maco_act(float v)` for a SMOOTH activation, as torch computes it."""
    _check_smooth(activation)
    if activation == "hardswish":  # x * min(max(x + 3, 0), 6) / 6; a NaN x makes the product NaN
        return ("static inline float maco_act(float v) {\n  float c = v + 3.f; c = c > 0.f ? c : 0.f; "
                "c = c < 6.f ? c : 6.f;\n  return v * c / 6.f;\n}")
    steps = _EXP_STEPS.format(F="float", sel_hi="t > 88.f ? 88.f : t", sel_lo="t < -87.f ? -87.f : t")
    body = _ACT_BODY[activation].format(F="float", exp="maco_exp", abs_v="(v < 0.f ? -v : v)",
                                        c_or_2_minus_c="(v < 0.f ? c : 2.f - c)")
    return f"""static inline float maco_exp(float t) {{
  const int big = t > 88.f;
{steps}
  unsigned pb, fb;
  __builtin_memcpy(&pb, &p, 4); __builtin_memcpy(&fb, &f, 4);
  pb += (fb - 0x4B400000u) << 23;
  __builtin_memcpy(&p, &pb, 4);
  return big ? __builtin_inff() : p;
}}
static inline float maco_act(float v) {{
{body}
}}"""


def vector_function(activation: str, lanes: int) -> str:
    """C `static inline maco_vf maco_vact(maco_vf v)` on GCC vectors of `lanes` floats (the same
    type as __m256 / __m512 at 8 / 16: cast those to maco_vf) for a SMOOTH activation; it defines
    maco_vf and maco_vu first."""
    _check_smooth(activation)
    head = (f"typedef float maco_vf __attribute__((vector_size({4 * lanes})));\n"
            f"typedef unsigned maco_vu __attribute__((vector_size({4 * lanes})));\n"
            "static inline maco_vf maco_sel(maco_vu m, maco_vf a, maco_vf b) "
            "{ return (maco_vf)(((maco_vu)a & m) | ((maco_vu)b & ~m)); }\n" + _min_max(lanes, "maco_vf", "maco_vu", "maco_"))
    if activation == "hardswish":
        return head + ("static inline maco_vf maco_vact(maco_vf v) {\n  const maco_vf zero = {0};\n"
                       "  maco_vf c = v + 3.f;\n  c = maco_sel((maco_vu)(c > zero), c, zero);\n"
                       "  c = maco_sel((maco_vu)(c < zero + 6.f), c, zero + 6.f);\n  return v * c / 6.f;\n}")
    steps = _EXP_STEPS.format(F="maco_vf", sel_hi="maco_vmin(zero + 88.f, t)", sel_lo="maco_vmax(zero - 87.f, t)")
    body = _ACT_BODY[activation].format(F="maco_vf", exp="maco_vexp", abs_v="maco_sel((maco_vu)(v < zero), -v, v)",
                                        c_or_2_minus_c="maco_sel((maco_vu)(v < zero), c, 2.f - c)")
    return head + f"""static inline maco_vf maco_vexp(maco_vf t) {{
  const maco_vf zero = {{0}};
  const maco_vu big = (maco_vu)(t > zero + 88.f);
{steps}
  p = (maco_vf)((maco_vu)p + (((maco_vu)f - 0x4B400000u) << 23));
  return maco_sel(big, zero + __builtin_inff(), p);
}}
static inline maco_vf maco_vact(maco_vf v) {{
  const maco_vf zero = {{0}}; (void)zero;
{body}
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
