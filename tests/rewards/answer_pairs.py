"""(answer in the box, ground truth, expected reward) across the six benchmarks' answer styles.

Ground truths are written as the data loaders hand them over (olympiadbench's multiple answers
joined with ", ", dollar signs kept; amc23's float as "27.0"; gsm8k's "2,125").
"""

ANSWER_PAIRS: list[tuple[str, str, float]] = [
    # integers (AIME, DAPO, gsm8k) and amc23's floats
    ("204", "204", 1.0),
    ("0204", "204", 1.0),
    ("205", "204", 0.0),
    ("27", "27.0", 1.0),
    ("27.5", "27.0", 0.0),
    ("2125", "2,125", 1.0),
    ("1,234", "1234", 1.0),
    ("-3", "-3", 1.0),
    ("3", "-3", 0.0),
    # fractions and decimals
    ("\\frac12", "0.5", 1.0),
    ("1/2", "\\frac{1}{2}", 1.0),
    ("\\dfrac{1}{2}", "\\frac{1}{2}", 1.0),
    ("0.5", "1/2", 1.0),
    ("\\frac{2}{4}", "\\frac12", 1.0),
    ("\\frac{1}{3}", "0.5", 0.0),
    ("-\\frac{3}{4}", "-0.75", 1.0),
    ("\\frac{3}{4}", "-\\frac{3}{4}", 0.0),
    ("3.140", "3.14", 1.0),
    ("3.15", "3.14", 0.0),
    ("0.333333", "\\frac{1}{3}", 1.0),
    ("-\\frac{1}{2}", "-0.5", 1.0),
    # intervals
    ("(1, 2]", "(1,2]", 1.0),
    ("[1, 2]", "(1,2]", 0.0),
    ("(-\\infty, 3)", "(-\\infty,3)", 1.0),
    ("[0, \\infty)", "[0,\\infty)", 1.0),
    ("(-\\infty, -1) \\cup (1, \\infty)", "(-\\infty,-1)\\cup(1,\\infty)", 1.0),
    (
        "\\left[ \\frac{\\pi^2}{8}, \\frac{5 \\pi^2}{4} \\right]",
        "\\left[ \\frac{\\pi^2}{8}, \\frac{5 \\pi^2}{4} \\right]",
        1.0,
    ),
    # tuples and points
    ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("(2, 3)", "(3, 2)", 0.0),
    ("(1,2,3)", "(1, 2, 3)", 1.0),
    ("(6,3),(9,3),(9,5),(54,5)", "$(6,3),(9,3),(9,5),(54,5)$", 1.0),
    # units and \text
    ("5\\text{ cm}", "5", 1.0),
    ("5 \\text{cm}", "5", 1.0),
    ("6\\text{ cm}", "5", 0.0),
    ("12 \\mathrm{~m}", "12", 1.0),
    ("\\text{(C)}", "\\text{(C)}", 1.0),
    ("\\text{Monday}", "\\text{Monday}", 1.0),
    ("\\text{Tuesday}", "\\text{Monday}", 0.0),
    ("\\text{even}", "\\text{odd}", 0.0),
    # degrees
    ("30^\\circ", "30", 1.0),
    ("30^{\\circ}", "30^\\circ", 1.0),
    ("45^\\circ", "30", 0.0),
    # percentages
    ("50\\%", "50", 1.0),
    ("25\\%", "50", 0.0),
    ("12.5\\%", "12.5", 1.0),
    # square roots
    ("2\\sqrt{2}", "\\sqrt{8}", 1.0),
    ("\\sqrt{3}", "\\sqrt{2}", 0.0),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", 1.0),
    # pi
    ("2\\pi", "2 \\pi", 1.0),
    ("\\pi/3", "\\frac{\\pi}{3}", 1.0),
    ("\\frac{\\pi}{4}", "\\frac{\\pi}{3}", 0.0),
    ("6.28", "2\\pi", 0.0),
    # sets and multiple answers (olympiadbench)
    ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}", 1.0),
    ("\\{1, 2\\}", "\\{1, 2, 3\\}", 0.0),
    ("1, 3, 5", "1,3,5", 1.0),
    ("84, 69", "$69$,$84$", 1.0),
    ("69", "$69$,$84$", 0.0),
    # equations against values
    ("x = 3", "3", 1.0),
    ("3", "x=3", 1.0),
    ("x = 4", "3", 0.0),
    ("y = 2x + 3", "y=2x+3", 1.0),
    ("y = 3x + 2", "y = 2x + 3", 0.0),
    # matrices and vectors (math500)
    (
        "\\begin{pmatrix} -18 \\\\ -49 \\\\ 96 \\end{pmatrix}",
        "\\begin{pmatrix} -18 \\\\ -49 \\\\ 96 \\end{pmatrix}",
        1.0,
    ),
    ("\\begin{pmatrix} 1/3 \\\\ 2/3 \\end{pmatrix}", "\\begin{pmatrix} \\frac13 \\\\ \\frac23 \\end{pmatrix}", 1.0),
    ("\\begin{pmatrix} 1 \\\\ 3 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 0.0),
    # expressions in n or x (olympiadbench "Expression")
    ("x^2+2x+1", "(x+1)^2", 1.0),
    ("2n", "$2 n$", 1.0),
    ("n^2 - n + 1", "$n^{2}-n+1$", 1.0),
    ("n^2+1", "$n^{2}-n+1$", 0.0),
    ("\\frac{n(n+1)}{2}", "\\frac{n^2+n}{2}", 1.0),
    # scientific notation (minerva)
    ("4.5 \\times 10^{33}", "4.5e33", 1.0),
    ("4.6 \\times 10^{33}", "4.5e33", 0.0),
    ("1.6", "1.6", 1.0),
    ("1.325 \\times 10^{-27}", "1.325e-27", 1.0),
    ("1.323 \\times 10^{-27}", "1.325e-27", 0.0),  # math_verify alone rounds both to 0
    ("0.00001", "1e-5", 1.0),
    ("2 \\times 10^{-7}", "1e-7", 0.0),
    # complex numbers and inequalities
    ("1+2i", "1 + 2i", 1.0),
    ("1-2i", "1+2i", 0.0),
    ("x \\geq 2", "x\\ge2", 1.0),
    ("x > 2", "x \\geq 2", 0.0),
]


def boxed_response(answer: str) -> str:
    """A response with some reasoning (inline math, an earlier box) before the final box."""
    return (
        "We set up the equation $x + 1 = 2$ and note that \\boxed{0} was only a guess.\n"
        "Working through the cases step by step gives the result.\n"
        f"Therefore the final answer is $\\boxed{{{answer}}}$."
    )
