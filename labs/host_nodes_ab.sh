#!/usr/bin/env bash
# The whole-token decode graph (CPU experts in CUDA host nodes, SHARPI_HOST_NODES=1) against a graph a segment
# (the default) on F at 12 GiB (auto) and --moe cpu, one box, one job: the host node's compile time, the CUDA tests of
# both paths, then `sharpi bench` of each. Run from the repository root on the GPU box with the gguf and platformdirs
# wheels of .gpucarry (packaging/gpu_sidebyside/prepare.sh):  OUT=/tmp/hn bash labs/host_nodes_ab.sh
mkdir -p "${OUT:=/tmp/hn}"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpucarry/whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:.
nproc; lscpu | grep -E "Model name|Thread\(s\)|Core\(s\)|Socket|NUMA node\(s\)"; nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import numba; print('numba', numba.__version__, numba.config.NUMBA_NUM_THREADS, numba.config.THREADING_LAYER)"
python3 -c "import time; t=time.time(); from engine.kernels import moe_host_node; moe_host_node.node_address(); print('node compile s', round(time.time()-t,1))"
python3 -c "import time; t=time.time(); from engine.kernels import moe_host_node; moe_host_node.node_address(); print('node compile again s', round(time.time()-t,1))"
echo "t=$(el) tests"
python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_graph_decode.py tests/test_moe_host.py 2>&1 | tail -4
echo "t=$(el) synth"
[ -e /tmp/F.gguf ] || python3 -m engine.cli.main synth --geometry qwen3-30b-a3b -o /tmp/F.gguf --fill-random > /tmp/synth.log 2>&1
echo "t=$(el) benches"
for spec in "auto 1" "auto 0" "cpu 1" "cpu 0"; do
  set -- $spec
  [ $(el) -gt ${LIMIT:-470} ] && { echo "skip $spec (time)"; continue; }
  extra=(); [ "$1" = cpu ] && extra=(--moe cpu)
  SHARPI_HOST_NODES=$2 python3 -m engine.cli.main bench -m /tmp/F.gguf --prompt 512 --gen 64 --repeat 2 --device cuda --vram 12GiB --json "${extra[@]}" > $OUT/b_$1_$2.json 2> $OUT/b_$1_$2.err
  python3 -c "import json,sys; r=json.load(open('$OUT/b_$1_$2.json')); print('$1 hn=$2', 'prompt', round(r['prompt_tok_s'],1), 'decode', round(r['decode_tok_s'],2), r['decode_tok_s_all'], r.get('placement','')[:200])" || tail -5 $OUT/b_$1_$2.err
  echo "t=$(el)"
done
