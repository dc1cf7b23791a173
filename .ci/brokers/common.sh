# Shared by the broker scripts beside this file: where the jars are cached, and how to
# fetch them. Sourced, not run.

brokers_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${IDEMPOTENT_CACHE:-$HOME/.cache/idempotent}"

# The version a pom names for itself (its first <version>, which is the broker's).
pom_version() { grep -m 1 -o '<version>[^<]*</version>' "$brokers_dir/$1.pom.xml" | sed 's/<[^>]*>//g'; }

# Prints the directory holding NAME's jars (NAME is `kafka` or `rocketmq`), copying them
# from Maven Central into the cache first if they are not there yet. The copy goes to a
# temporary directory renamed at the end, so an interrupted download is never used.
broker_lib() {
  local name="$1" version lib
  version="$(pom_version "$name")"
  lib="$cache_root/$name-$version/lib"
  if [ ! -d "$lib" ]; then
    command -v mvn >/dev/null || { echo "Maven (mvn) is needed to fetch $name $version" >&2; return 1; }
    mkdir -p "$cache_root/$name-$version"
    local partial="$lib.partial.$$"
    rm -rf "$partial"
    echo "fetching $name $version from Maven Central into $lib" >&2
    mvn -q -B -Dstyle.color=never -f "$brokers_dir/$name.pom.xml" dependency:copy-dependencies \
      -DoutputDirectory="$partial" -DincludeScope=runtime >&2
    mv "$partial" "$lib"
  fi
  echo "$lib"
}

# The JVM's options: a small heap and one GC thread, for brokers of the tests (a few
# thousand records, two cores shared with the consumers and often several brokers at
# once). IDEMPOTENT_JVM_OPTS replaces them.
jvm_opts() {
  echo "${IDEMPOTENT_JVM_OPTS:--Xms256m -Xmx768m -XX:+UseSerialGC -XX:-UsePerfData}"
}
