// Command gopeers times the Go decoders of vLLM KV-event batches that other routers ship,
// imported as modules (nothing copied), on payload files written by the kvbridge bench.
//
//	gopeers [-warmup N] FILE...
//
// Each FILE is in the bench's payload format (bench/peers.py, "KVBPAYL1"). For every file
// and every decoder, one timed pass decodes every payload once, after an untimed warm-up pass
// over its first N payloads. A batch a decoder rejects is counted (with its first error) and
// the pass goes on. CPU time is the process's (getrusage RUSAGE_SELF: the garbage collector's
// threads included). One JSON document goes to stdout.
package main

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"syscall"
	"time"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
	"github.com/vllm-project/aibrix/pkg/cache/kvcache"
	"github.com/vmihailenco/msgpack/v5"
)

const magic = "KVBPAYL1"

const (
	pod   = "pod-0"
	model = "bench-model"
)

// A decoder decodes one payload and says how many events it found.
type decoder struct {
	name, what string
	decode     func(payload []byte) (int, error)
}

func decoders() []decoder {
	llmd := engineadapter.NewVLLMAdapter()
	topic := "kv@" + pod + "@" + model
	return []decoder{
		{
			"aibrix", "AIBrix kvcache.DecodeEventBatch",
			func(p []byte) (int, error) {
				b, err := kvcache.DecodeEventBatch(p, model, pod)
				if err != nil {
					return 0, err
				}
				return len(b.Events), nil
			},
		},
		{
			"llm-d", "llm-d engineadapter.VLLMAdapter.ParseMessage",
			func(p []byte) (int, error) {
				_, _, b, err := llmd.ParseMessage(&kvevents.RawMessage{Topic: topic, Payload: p})
				if err != nil {
					return 0, err
				}
				return len(b.Events), nil
			},
		},
		{
			"msgpack", "vmihailenco/msgpack/v5 Unmarshal into interface{} (the floor)",
			func(p []byte) (int, error) {
				var v any
				if err := msgpack.Unmarshal(p, &v); err != nil {
					return 0, err
				}
				batch, ok := v.([]any)
				if !ok || len(batch) < 2 {
					return 0, fmt.Errorf("not a [ts, events, ...] array: %T", v)
				}
				events, ok := batch[1].([]any)
				if !ok {
					return 0, fmt.Errorf("events: not an array: %T", batch[1])
				}
				return len(events), nil
			},
		},
	}
}

// readPayloads reads a payload file: magic, uint32 LE count, count x (uint32 LE length, bytes).
func readPayloads(path string) ([][]byte, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	if len(data) < len(magic)+4 || string(data[:len(magic)]) != magic {
		return nil, errors.New("not a payload file (bad magic)")
	}
	pos := len(magic)
	count := binary.LittleEndian.Uint32(data[pos:])
	pos += 4
	payloads := make([][]byte, 0, count)
	for i := uint32(0); i < count; i++ {
		if len(data)-pos < 4 {
			return nil, fmt.Errorf("truncated at payload %d of %d", i, count)
		}
		n := int(binary.LittleEndian.Uint32(data[pos:]))
		pos += 4
		if len(data)-pos < n {
			return nil, fmt.Errorf("truncated in payload %d of %d", i, count)
		}
		payloads = append(payloads, data[pos:pos+n:pos+n])
		pos += n
	}
	if pos != len(data) {
		return nil, fmt.Errorf("%d bytes after the last payload", len(data)-pos)
	}
	return payloads, nil
}

func cpuSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

type result struct {
	File          string  `json:"file"`
	Decoder       string  `json:"decoder"`
	Batches       int     `json:"batches"`
	OKBatches     int     `json:"ok_batches"`
	FailedBatches int     `json:"failed_batches"`
	Events        int     `json:"events"`
	CPUSeconds    float64 `json:"cpu_seconds"`
	WallSeconds   float64 `json:"wall_seconds"`
	FirstError    string  `json:"first_error,omitempty"`
}

func run(d decoder, file string, payloads [][]byte, warmup int) result {
	for _, p := range payloads[:min(warmup, len(payloads))] {
		_, _ = d.decode(p)
	}
	r := result{File: file, Decoder: d.name, Batches: len(payloads)}
	t0, c0 := time.Now(), cpuSeconds()
	for _, p := range payloads {
		n, err := d.decode(p)
		if err != nil {
			r.FailedBatches++
			if r.FirstError == "" {
				r.FirstError = err.Error()
			}
			continue
		}
		r.OKBatches++
		r.Events += n
	}
	r.CPUSeconds, r.WallSeconds = cpuSeconds()-c0, time.Since(t0).Seconds()
	return r
}

func main() {
	warmup := flag.Int("warmup", 200, "untimed warm-up: decode this many payloads first")
	flag.Parse()
	if flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: gopeers [-warmup N] FILE...")
		os.Exit(2)
	}
	doc := map[string]any{
		"go":         runtime.Version(),
		"gomaxprocs": runtime.GOMAXPROCS(0),
		"decoders":   map[string]string{},
		"modules":    map[string]string{},
	}
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, m := range info.Deps {
			switch m.Path {
			case "github.com/vllm-project/aibrix", "github.com/llm-d/llm-d-kv-cache",
				"github.com/vmihailenco/msgpack/v5":
				doc["modules"].(map[string]string)[m.Path] = m.Version
			}
		}
	}
	var results []result
	for _, file := range flag.Args() {
		payloads, err := readPayloads(file)
		if err != nil {
			fmt.Fprintf(os.Stderr, "gopeers: %s: %v\n", file, err)
			os.Exit(1)
		}
		for _, d := range decoders() {
			doc["decoders"].(map[string]string)[d.name] = d.what
			results = append(results, run(d, file, payloads, *warmup))
		}
	}
	doc["results"] = results
	out := json.NewEncoder(os.Stdout)
	out.SetIndent("", " ")
	if err := out.Encode(doc); err != nil {
		fmt.Fprintf(os.Stderr, "gopeers: %v\n", err)
		os.Exit(1)
	}
}
