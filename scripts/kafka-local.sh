#!/usr/bin/env bash
# A real single-node Apache Kafka broker (KRaft, broker + controller in one JVM), run with
# java alone: no Docker. The jars come from Maven Central and are cached per version in
# .kafka-local/<version>/libs at the repository root.
#
#   scripts/kafka-local.sh fetch             download the broker's jars (skips if cached)
#   scripts/kafka-local.sh start [options]   format if new, start in the background, wait;
#                                            last line: kafka-local: bootstrap servers HOST:PORT
#   scripts/kafka-local.sh run   [options]   the same in the foreground (exec's the JVM)
#   scripts/kafka-local.sh stop  [options]   TERM the broker by its pid file, then KILL
#   scripts/kafka-local.sh status [options]  exit 0 if running, 3 if not
#
# Options (each also an environment variable):
#   --port N             KAFKA_LOCAL_PORT             client listener on 127.0.0.1 (9092)
#   --controller-port N  KAFKA_LOCAL_CONTROLLER_PORT  KRaft controller listener (9093)
#   --data-dir DIR       KAFKA_LOCAL_DATA_DIR         data, pid file, properties (.kafka-local/data)
#   --log-dir DIR        KAFKA_LOCAL_LOG_DIR          server.log goes here (<data dir>/logs)
#   --heap SIZE          KAFKA_LOCAL_HEAP             JVM heap (512m)
#   --timeout SECONDS    KAFKA_LOCAL_TIMEOUT          how long start waits for readiness (90)
#   KAFKA_LOCAL_VERSION  the kafka_2.13 release (4.3.2); KAFKA_LOCAL_CACHE the cache root;
#   KAFKA_LOCAL_JAVA_OPTS extra JVM options.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRIPTS="$ROOT/scripts"
VERSION="${KAFKA_LOCAL_VERSION:-4.3.2}"
CACHE="${KAFKA_LOCAL_CACHE:-$ROOT/.kafka-local}"
LIBS="$CACHE/$VERSION/libs"
READY_LINE="Kafka Server started"

PORT="${KAFKA_LOCAL_PORT:-9092}"
CONTROLLER_PORT="${KAFKA_LOCAL_CONTROLLER_PORT:-9093}"
DATA_DIR="${KAFKA_LOCAL_DATA_DIR:-$CACHE/data}"
LOG_DIR="${KAFKA_LOCAL_LOG_DIR:-}"
HEAP="${KAFKA_LOCAL_HEAP:-512m}"
TIMEOUT="${KAFKA_LOCAL_TIMEOUT:-90}"
# Lines of the broker log worth showing when it fails: log4j errors, Java exceptions.
ERROR_LINES=' (ERROR|FATAL) |^Error|^Caused by:|^[A-Za-z0-9_.$]+(Exception|Error)(:|$)'
START_OFFSET=0 # size of the log before this start: readiness and errors are looked for after it

die() {
    echo "kafka-local: $*" >&2
    exit 1
}

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

parse_options() {
    while (($#)); do
        case "$1" in
            --port) PORT="${2:?--port needs a value}"; shift 2 ;;
            --controller-port) CONTROLLER_PORT="${2:?--controller-port needs a value}"; shift 2 ;;
            --data-dir) DATA_DIR="${2:?--data-dir needs a value}"; shift 2 ;;
            --log-dir) LOG_DIR="${2:?--log-dir needs a value}"; shift 2 ;;
            --heap) HEAP="${2:?--heap needs a value}"; shift 2 ;;
            --timeout) TIMEOUT="${2:?--timeout needs a value}"; shift 2 ;;
            -h | --help) usage ;;
            *) die "unknown option '$1' (see: $0 --help)" ;;
        esac
    done
    DATA_DIR="$(realpath -m "$DATA_DIR")"
    LOG_DIR="$(realpath -m "${LOG_DIR:-$DATA_DIR/logs}")"
    PID_FILE="$DATA_DIR/kafka.pid"
    PROPS="$DATA_DIR/server.properties"
    LOG_FILE="$LOG_DIR/server.log"
}

# ---------------------------------------------------------------------------- fetch

cmd_fetch() {
    if [[ -f "$LIBS/.complete" ]]; then
        echo "kafka-local: Kafka $VERSION already in $LIBS"
        return 0
    fi
    command -v mvn >/dev/null || die "Maven (mvn) is needed to fetch Kafka's jars: apt-get install maven"
    local tmp="$CACHE/$VERSION/libs.partial"
    rm -rf "$tmp"
    mkdir -p "$tmp"
    # shellcheck disable=SC2064 # expand now: $tmp is local
    trap "rm -rf '$tmp'; rmdir --ignore-fail-on-non-empty '$CACHE/$VERSION' 2>/dev/null" EXIT
    local mvn=(mvn -B -q -f "$SCRIPTS/kafka-pom.xml" dependency:copy-dependencies
        -DincludeScope=runtime -DoutputDirectory="$tmp" -Dkafka.version="$VERSION")
    echo "kafka-local: fetching Kafka $VERSION from Maven Central into $LIBS" \
        "(about 50 jars, 60 MB; a minute or more on a fresh machine, cached afterwards)"
    local out
    out="$("${mvn[@]}" 2>&1)" || die "Maven could not resolve org.apache.kafka:kafka_2.13:$VERSION:"$'\n'"$out"

    # The published POMs carry no logging backend; pick the log4j2 binding that matches the
    # slf4j-api the broker resolved, at the log4j-core version it already pulls in.
    local slf4j binding log4j core
    slf4j="$(find "$tmp" -name 'slf4j-api-*.jar' -printf '%f\n' | head -n1)"
    [[ -n "$slf4j" ]] || die "no slf4j-api jar among Kafka $VERSION's dependencies"
    case "$slf4j" in
        slf4j-api-1.*) binding="log4j-slf4j-impl" ;;
        *) binding="log4j-slf4j2-impl" ;;
    esac
    core="$(find "$tmp" -name 'log4j-core-*.jar' -printf '%f\n' | head -n1)"
    log4j="${core#log4j-core-}"
    log4j="${log4j%.jar}"
    log4j="${log4j:-2.25.3}"
    out="$("${mvn[@]}" -Dlog4j.binding="$binding" -Dlog4j.version="$log4j" 2>&1)" ||
        die "Maven could not resolve org.apache.logging.log4j:$binding:$log4j:"$'\n'"$out"
    [[ -f "$tmp/kafka_2.13-$VERSION.jar" ]] || die "kafka_2.13-$VERSION.jar missing after fetch"
    touch "$tmp/.complete"
    rm -rf "$LIBS"
    mv "$tmp" "$LIBS"
    echo "kafka-local: $(find "$LIBS" -name '*.jar' | wc -l) jars ($binding $log4j over $slf4j)"
}

# ---------------------------------------------------------------------------- start / run

running_pid() {
    # The pid in the pid file if that process is alive and is our broker, else nothing.
    [[ -f "$PID_FILE" ]] || return 1
    local pid
    pid="$(<"$PID_FILE")"
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [[ -r "/proc/$pid/cmdline" ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -e 'kafka\.Kafka' -e 'kafka-local\.sh' || return 1
    echo "$pid"
}

write_properties() {
    cat >"$PROPS" <<EOF
# Written by scripts/kafka-local.sh on every start; edits are overwritten.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$PORT
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$DATA_DIR/kraft
num.partitions=1
auto.create.topics.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# After a crash the controller waits this long for the dead incarnation's session to expire
# before the restarted broker may register (default 9 s).
broker.session.timeout.ms=5000
broker.heartbeat.interval.ms=1000
EOF
}

java_options() {
    # What Kafka's own kafka-run-class.sh adds, with a smaller heap.
    JAVA_OPTS=(-server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35
        -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true "-Dkafka.logs.dir=$LOG_DIR"
        "-Dlog4j2.configurationFile=$SCRIPTS/kafka-log4j2.xml" -cp "$LIBS/*")
    # Extra JVM options, word-split on purpose (e.g. KAFKA_LOCAL_JAVA_OPTS="-XX:+UseSerialGC").
    # shellcheck disable=SC2206
    JAVA_OPTS+=(${KAFKA_LOCAL_JAVA_OPTS:-})
}

format_if_new() {
    [[ -f "$DATA_DIR/kraft/meta.properties" ]] && return 0
    local id
    # A cluster id is a UUID in 22 characters of unpadded URL-safe base64; like Kafka's own
    # generator, avoid a leading '-' (it would read as an option).
    id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | cut -c1-22)"
    [[ "$id" == -* ]] && id="K${id:1}"
    echo "kafka-local: formatting $DATA_DIR/kraft (cluster id $id)" >>"$LOG_FILE"
    java -Xmx256m "${JAVA_OPTS[@]}" kafka.tools.StorageTool format \
        -t "$id" -c "$PROPS" >>"$LOG_FILE" 2>&1 ||
        die "formatting $DATA_DIR/kraft failed$(log_excerpt)"
}

log_excerpt() {
    # The errors logged since this start, then the log's tail. Nothing when stderr is the log
    # itself (`run`): repeating the log into the log would only add noise.
    [[ /dev/stderr -ef "$LOG_FILE" ]] && return 0
    local errors
    errors="$(tail -c "+$((START_OFFSET + 1))" "$LOG_FILE" |
        grep -E "$ERROR_LINES" | tail -n 10 || true)"
    [[ -n "$errors" ]] && printf '; errors logged:\n%s\n' "$errors"
    printf '; last lines of %s:\n%s' "$LOG_FILE" "$(tail -n 30 "$LOG_FILE")"
}

prepare() {
    local pid
    if pid="$(running_pid)"; then
        die "a broker is already running from $DATA_DIR (pid $pid); stop it first"
    fi
    [[ -f "$LIBS/.complete" ]] || cmd_fetch >&2
    command -v java >/dev/null || die "java (17 or newer) is needed to run Kafka $VERSION"
    mkdir -p "$DATA_DIR" "$LOG_DIR"
    touch "$LOG_FILE"
    write_properties
    java_options
    format_if_new
}

cmd_run() {
    prepare
    echo "kafka-local: starting Kafka $VERSION on 127.0.0.1:$PORT (pid $$)" >>"$LOG_FILE"
    echo "$$" >"$PID_FILE"
    exec java "-Xms$HEAP" "-Xmx$HEAP" "${JAVA_OPTS[@]}" kafka.Kafka "$PROPS"
}

cmd_start() {
    local pid
    if pid="$(running_pid)"; then
        echo "kafka-local: already running (pid $pid)"
        echo "kafka-local: bootstrap servers $(bootstrap)"
        return 0
    fi
    [[ -f "$LOG_FILE" ]] && START_OFFSET="$(stat -c %s "$LOG_FILE")"
    prepare
    echo "kafka-local: starting Kafka $VERSION on 127.0.0.1:$PORT" >>"$LOG_FILE"
    nohup java "-Xms$HEAP" "-Xmx$HEAP" "${JAVA_OPTS[@]}" kafka.Kafka "$PROPS" >>"$LOG_FILE" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$PID_FILE"

    local deadline=$((SECONDS + TIMEOUT))
    until grep -q "$READY_LINE" < <(tail -c "+$((START_OFFSET + 1))" "$LOG_FILE"); do
        if ! alive "$pid"; then
            rm -f "$PID_FILE"
            die "the broker exited during startup$(log_excerpt)"
        fi
        if ((SECONDS >= deadline)); then
            stop_pid "$pid"
            die "the broker was not ready after ${TIMEOUT}s (stopped it)$(log_excerpt)"
        fi
        sleep 0.2
    done
    echo "kafka-local: Kafka $VERSION ready (pid $pid, log $LOG_FILE)"
    echo "kafka-local: bootstrap servers $(bootstrap)"
}

# ---------------------------------------------------------------------------- stop / status

alive() {
    # Running (or paused), not gone and not a zombie.
    local stat
    stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
    stat="${stat##*) }"
    [[ "${stat:0:1}" != Z ]]
}

stop_pid() {
    local pid="$1" waited=0
    kill -TERM "$pid" 2>/dev/null || return 0
    kill -CONT "$pid" 2>/dev/null || true # a paused (SIGSTOP) broker must wake to exit
    while alive "$pid" && ((waited < 300)); do
        sleep 0.1
        waited=$((waited + 1))
    done
    if alive "$pid"; then
        echo "kafka-local: pid $pid ignored TERM for 30s; killing it" >&2
        kill -KILL "$pid" 2>/dev/null || true
    fi
}

cmd_stop() {
    local pid
    if ! pid="$(running_pid)"; then
        rm -f "$PID_FILE"
        echo "kafka-local: not running"
        return 0
    fi
    stop_pid "$pid"
    rm -f "$PID_FILE"
    echo "kafka-local: stopped (pid $pid)"
}

bootstrap() {
    # The address clients use, as the running broker's properties advertise it.
    sed -n 's|^advertised.listeners=PLAINTEXT://||p' "$PROPS"
}

cmd_status() {
    local pid
    if pid="$(running_pid)"; then
        echo "kafka-local: running (pid $pid), bootstrap $(bootstrap), data $DATA_DIR"
        return 0
    fi
    echo "kafka-local: not running (data $DATA_DIR)"
    return 3
}

main() {
    local cmd="${1:-}"
    (($#)) && shift
    case "$cmd" in
        fetch) cmd_fetch ;;
        start) parse_options "$@" && cmd_start ;;
        run) parse_options "$@" && cmd_run ;;
        stop) parse_options "$@" && cmd_stop ;;
        status) parse_options "$@" && cmd_status ;;
        -h | --help | help | "") usage ;;
        *) echo "kafka-local: unknown command '$cmd'" >&2 && usage ;;
    esac
}

main "$@"
