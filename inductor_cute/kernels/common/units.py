"""The units attention scores are kept in, shared by the kernels and their host code (plain Python).

The kernels' softmax runs on exp2/log2 (one MUFU op each): scores are multiplied by LOG2E once
(folded into the softmax scale), a logsumexp comes out in log2 units and is turned into natural-log
units (flex_attention's) by multiplying with LN2. A masked score is NEG_INF.
"""

import math

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
NEG_INF = -math.inf
