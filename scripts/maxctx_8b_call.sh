# The device call for QLoRA's longest context at the Llama-3-8B shape (bash scripts/maxctx_8b_call.sh;
# ~5 min): the whole 32-layer step at 524,288 tokens runs past the device's 10-minute command limit
# (attention alone is ~13 minutes of it) and its offloaded layer inputs (32 x 524,288 x 4096 x 2
# bytes = 137 GB) exceed the host's 128 GiB, so the 8B shape runs here with LAYERS (default "2 4")
# decoder layers: NF4 + double quantisation, LoRA r=16 on every linear, offloaded activations and
# the tiled MLP, GPU memory capped at 80 GB. The peaks' difference per layer is the slope to 32
# layers; every other term of the peak is one layer's working set, the same at any depth.
# VARIANTS=unsloth runs Unsloth's offloading checkpointing instead (its wheels from .whl-peers).
if [ "${VARIANTS:-long}" = long ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/bnb .whl-peers/bitsandbytes-*.whl
  export PYTHONPATH=src:/tmp/bnb
else
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer-site .whl-peers/*.whl
  export PYTHONPATH=/tmp/peer-site:src
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for layers in ${LAYERS:-2 4}; do
  shape="{\"hidden_size\": 4096, \"intermediate_size\": 14336, \"num_hidden_layers\": $layers, \"num_attention_heads\": 32, \"num_key_value_heads\": 8, \"vocab_size\": 128256, \"tie_word_embeddings\": false, \"rope_theta\": 500000.0}"
  timeout ${CASE_S:-270} python3 -m tigon.bench.max_context --shape "$shape" --quant nf4 --seq ${SEQ:-524288} \
    --variants ${VARIANTS:-long} --warmup 0 --memory-cap 80 --isolate --out $OUT/${VARIANTS:-long}$layers > $OUT/maxctx_${VARIANTS:-long}_$layers.txt 2>&1
  echo "== $layers layers (rc $?)"; tail -6 $OUT/maxctx_${VARIANTS:-long}_$layers.txt
done
free -g | head -2
