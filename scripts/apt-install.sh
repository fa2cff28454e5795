#!/usr/bin/env bash
# Installs Debian packages for the other scripts (as root, or through sudo), the one
# way they all do it: after one look at the package lists (a new machine may never
# have read them), and without the packages they merely recommend. Those are most of
# the download: docker-compose recommends a Docker engine, npm a test framework and git,
# chromium a desktop's printing and notification services. On a plain Debian 12 the
# services and test tools came to 735 packages instead of 1,029 (BENCHMARKS.md, "How
# long the test suite takes").
#
#   scripts/apt-install.sh PACKAGE...
set -euo pipefail
[ $# -gt 0 ] || exit 0
if [ "$(id -u)" = 0 ]; then sudo_cmd=(); else sudo_cmd=(sudo); fi
${sudo_cmd[@]+"${sudo_cmd[@]}"} apt-get update -qq
${sudo_cmd[@]+"${sudo_cmd[@]}"} env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
