#!/bin/bash
# Extract the GPT-OSS-20B megakernel trees (KevGomes1403/nki-moe-megakernel) whose device profiles the repository
# publishes, for fusegraph.perf.against_specs_gpt_oss:gpt_oss_megakernel(variant=...), into OUT and print the exports.
#
#   MK_GIT=<nki-moe-megakernel git dir> NKILIB_GIT=<nki-library git dir> benchmarks/prepare_gpt_oss_trees.sh OUT
#
# Only `git archive` of the mirrors (no network). Profiles: megakernels/gpt_oss/moe_dma_experiments_log.md @d6c1eb4.
#
#   OUT/exp7       9a3c4b5 as committed (branch debug_gpt_oss, code-identical to d6e69cf on main): the tree of the
#                  published "exp 7" profile (hoisted gate/up DMAs split in H1 halves, gate on HWDGE / up on
#                  SWDGE, 2-slot cross-expert prefetch ring).
#   OUT/exp6       9a3c4b5 with the prefetch ring off ("exp 6": the same hoisted Phase A/B DMAs issued in line by
#                  process_gate_up_projection). `use_prefetch_ring` is a local of _selective_expert_moe_tkg computed
#                  from params and the module constant _MOE_FUSION_ENABLED (NKI_MOE_ENABLE_FUSION); setting that
#                  env var would also switch on the fused gate+up load, another configuration, and no argument or
#                  env var turns the ring off alone. So the one line `use_prefetch_ring = (` becomes
#                  `use_prefetch_ring = False and (` with sed: the measurement configuration the author profiled
#                  as exp 6 (log l.382-428), not a change of ours. The sed must hit exactly one line, or the
#                  script fails.
#   OUT/canonical  "exp 0", the pre-experiment profile: 9a3c4b5 with 82fe502's nki_kernels/moe/selective_expert_impl.py
#                  (which calls nki-library's own process_gate_up_projection / process_down_projection: a
#                  per-HTile HWDGE gate/up load, 6 DMAs per projection and expert) and, for those, nki-library
#                  d2ad3a5 (whose mlp_tkg line numbers match the canonical profile: gate_up :470/:479, down
#                  :259/:296/:326; ddbca35 is the same for those files) in OUT/canonical-nkilib.
#                  9a3c4b5's vendored mlp_tkg_{gate_up,down}_projection.py stay in the tree, unused.
set -eu
: "${MK_GIT:?set MK_GIT to the git dir of KevGomes1403/nki-moe-megakernel}"
: "${NKILIB_GIT:?set NKILIB_GIT to the git dir of aws-neuron/nki-library}"
out=${1:?usage: MK_GIT=... NKILIB_GIT=... $0 OUT}
EXP7=9a3c4b5
CANON_SE=82fe502
CANON_NKILIB=d2ad3a5
SE=nki_kernels/moe/selective_expert_impl.py

for c in "$MK_GIT $EXP7" "$MK_GIT $CANON_SE" "$NKILIB_GIT $CANON_NKILIB"; do
    set -- $c
    git -C "$1" cat-file -e "$2^{commit}" || { echo "$1 lacks commit $2" >&2; exit 1; }
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
for d in exp7 exp6 canonical canonical-nkilib; do
    [ -e "$out/$d" ] && { echo "$out/$d exists; remove it first" >&2; exit 1; }
done

mkdir "$out/exp7" "$out/exp6" "$out/canonical" "$out/canonical-nkilib"
git -C "$MK_GIT" archive "$EXP7" | tar -x -C "$out/exp7"
git -C "$MK_GIT" archive "$EXP7" | tar -x -C "$out/exp6"
git -C "$MK_GIT" archive "$EXP7" | tar -x -C "$out/canonical"

# exp 6: the ring off (see above)
n=$(grep -c '^    use_prefetch_ring = ($' "$out/exp6/$SE" || true)
[ "$n" = 1 ] || { echo "exp6: expected one 'use_prefetch_ring = (' line in $SE, found $n" >&2; exit 1; }
sed -i 's/^    use_prefetch_ring = ($/    use_prefetch_ring = False and (  # exp 6 (prepare_gpt_oss_trees.sh)/' \
    "$out/exp6/$SE"

# canonical: 82fe502's selective expert over 9a3c4b5, nkilib from d2ad3a5
git -C "$MK_GIT" show "$CANON_SE:$SE" > "$out/canonical/$SE"
git -C "$NKILIB_GIT" archive "$CANON_NKILIB" src/nkilib_src/nkilib \
    | tar -x -C "$out/canonical-nkilib" --strip-components=2
# nki-library 2026-04-13 (d2ad3a5): core/mlp/mlp.py has a duplicated docstring tail (lines 203-214) Python cannot
# parse; drop it, as shared/tools/prepare_anchors.sh does (a bug of the library)
f="$out/canonical-nkilib/nkilib/core/mlp/mlp.py"
if ! python3 -c "import ast,sys; ast.parse(open(sys.argv[1]).read())" "$f" 2>/dev/null; then sed -i '203,214d' "$f"; fi
python3 -c "import ast,sys; ast.parse(open(sys.argv[1]).read())" "$f"

echo "export MK_GPTOSS_EXP7=$out/exp7 MK_GPTOSS_EXP6=$out/exp6 MK_GPTOSS_CANONICAL=$out/canonical" \
     "NKILIB_GPTOSS_CANONICAL=$out/canonical-nkilib"
