// Command benchchart turns `go test -bench` output (one or more runs, e.g.
// -count 3) into the handoff chart (SVG) and the tables of BENCHMARKS.md
// (Markdown, on standard output). Each figure is the median over the runs.
//
//	go run ./internal/benchchart -svg docs/handoff.svg docs/bench.txt
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"log"
	"math"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// results maps a benchmark name (without the -GOMAXPROCS suffix) and a unit
// to the values seen across runs.
type results map[string]map[string][]float64

func parse(r io.Reader, into results) error {
	line := regexp.MustCompile(`^(Benchmark\S+?)(-\d+)?\s+\d+\s+(.*)$`)
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		m := line.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		fields := strings.Fields(m[3])
		for i := 0; i+1 < len(fields); i += 2 {
			v, err := strconv.ParseFloat(fields[i], 64)
			if err != nil {
				continue
			}
			if into[m[1]] == nil {
				into[m[1]] = map[string][]float64{}
			}
			into[m[1]][fields[i+1]] = append(into[m[1]][fields[i+1]], v)
		}
	}
	return sc.Err()
}

// get returns the median of a benchmark's unit, and whether it was seen.
func (r results) get(name, unit string) (float64, bool) {
	vs := slices.Clone(r[name][unit])
	if len(vs) == 0 {
		return 0, false
	}
	slices.Sort(vs)
	return vs[len(vs)/2], true
}

var ns = []int{1, 10, 100, 500, 1000}

func main() {
	svg := flag.String("svg", "", "write the handoff chart here")
	flag.Parse()
	res := results{}
	for _, f := range flag.Args() {
		fh, err := os.Open(f)
		if err != nil {
			log.Fatal(err)
		}
		if err := parse(fh, res); err != nil {
			log.Fatal(err)
		}
		fh.Close()
	}
	if len(res) == 0 {
		log.Fatal("no benchmark lines read")
	}
	writeTables(os.Stdout, res)
	if *svg != "" {
		if err := os.WriteFile(*svg, []byte(chart(res)), 0o644); err != nil {
			log.Fatal(err)
		}
	}
}

func writeTables(w io.Writer, r results) {
	floor, _ := r.get("BenchmarkFloor", "floor-p50-ms")
	fmt.Fprintf(w, "Floor (one delete committed + its watch event at another client, raw watch stream): p50 %.3f ms\n\n", floor)
	if cw, ok := r.get("BenchmarkFloorClientWatch", "floor-p50-ms"); ok {
		fmt.Fprintf(w, "The same through clientv3.Watch, a watch per sample: p50 %.3f ms\n\n", cw)
	}
	for _, bench := range []struct{ title, name string }{
		{"Handoff, N waiters queued (holder's Unlock start -> next waiter's Lock return), p50 ms", "BenchmarkHandoff"},
		{"Handoff under steady contention (released holders queue again), p50 ms", "BenchmarkHandoffSteady"},
	} {
		fmt.Fprintf(w, "%s\n\n| N | etcdsync | concurrency | floor | etcdsync / floor | concurrency / floor | etcdsync / concurrency |\n|---|---|---|---|---|---|---|\n", bench.title)
		for _, n := range ns {
			ours, ok1 := r.get(fmt.Sprintf("%s/N=%d/etcdsync", bench.name, n), "handoff-p50-ms")
			theirs, ok2 := r.get(fmt.Sprintf("%s/N=%d/concurrency", bench.name, n), "handoff-p50-ms")
			if !ok1 || !ok2 {
				continue
			}
			fmt.Fprintf(w, "| %d | %.3f | %.3f | %.3f | %.2f | %.2f | %.2f |\n", n, ours, theirs, floor, ours/floor, theirs/floor, ours/theirs)
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "Other figures (median of runs)\n\n| benchmark | etcdsync | etcd (concurrency, or recipes for RWMutex) |\n|---|---|---|\n")
	var names []string
	for name := range r {
		if rest, ok := strings.CutSuffix(name, "/etcdsync"); ok && !strings.HasPrefix(rest, "BenchmarkHandoff/") && !strings.HasPrefix(rest, "BenchmarkHandoffSteady") {
			names = append(names, rest)
		}
		if strings.Contains(name, "/etcdsync/") { // BenchmarkWaiterCost/etcdsync/ahead=1
			names = append(names, name)
		}
	}
	sort.Strings(names)
	for _, name := range names {
		oursName, theirsName := name+"/etcdsync", name+"/concurrency"
		if strings.Contains(name, "/etcdsync/") {
			oursName, theirsName = name, strings.Replace(name, "/etcdsync/", "/concurrency/", 1)
		}
		if _, ok := r[theirsName]; !ok { // RWMutex: etcd's experimental recipe
			theirsName = strings.Replace(theirsName, "/concurrency", "/recipe", 1)
		}
		var units []string
		for u := range r[oursName] {
			units = append(units, u)
		}
		sort.Strings(units)
		for _, u := range units {
			ours, _ := r.get(oursName, u)
			theirs, ok := r.get(theirsName, u)
			t := "—"
			if ok {
				t = fmt.Sprintf("%.3g", theirs)
			}
			label := strings.TrimPrefix(strings.Replace(oursName, "/etcdsync", "", 1), "Benchmark")
			fmt.Fprintf(w, "| %s %s | %.3g | %s |\n", label, u, ours, t)
		}
	}
	singles := []struct{ name, unit string }{
		{"BenchmarkThroughput64/raw-put-delete", "ops/s"},
		{"BenchmarkHold10k", "heap-bytes/lock"},
		{"BenchmarkHold10k", "heap-MiB"},
		{"BenchmarkHold10k", "goroutines/lock"},
	}
	for _, single := range singles {
		if v, ok := r.get(single.name, single.unit); ok {
			fmt.Fprintf(w, "| %s %s | %.4g | |\n", strings.TrimPrefix(single.name, "Benchmark"), single.unit, v)
		}
	}
}

// chart draws p50 handoff latency against N for both libraries and the floor.
func chart(r results) string {
	const (
		width, height          = 640, 400
		left, right, top, bott = 70, 160, 40, 60
	)
	type series struct {
		label, color string
		ys           []float64
	}
	var ss []series
	maxY := 0.0
	for _, l := range []struct{ lib, color string }{{"etcdsync", "#1f77b4"}, {"concurrency", "#d62728"}} {
		s := series{label: l.lib, color: l.color}
		for _, n := range ns {
			v, _ := r.get(fmt.Sprintf("BenchmarkHandoff/N=%d/%s", n, l.lib), "handoff-p50-ms")
			s.ys = append(s.ys, v)
			maxY = max(maxY, v)
		}
		ss = append(ss, s)
	}
	floor, _ := r.get("BenchmarkFloor", "floor-p50-ms")
	floors := make([]float64, len(ns))
	for i := range floors {
		floors[i] = floor
	}
	ss = append(ss, series{label: "floor", color: "#555555", ys: floors})
	minY := floor
	for _, s := range ss {
		for _, y := range s.ys {
			if y > 0 {
				minY = min(minY, y)
			}
		}
	}
	// A log scale: the libraries differ by up to two orders of magnitude.
	lo, hi := math.Floor(math.Log10(minY)), math.Ceil(math.Log10(max(maxY, floor)))
	if hi <= lo {
		hi = lo + 1
	}
	px := func(i int) float64 { return left + float64(i)*float64(width-left-right)/float64(len(ns)-1) }
	py := func(v float64) float64 {
		return float64(height-bott) - (math.Log10(v)-lo)/(hi-lo)*float64(height-top-bott)
	}

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%d" y="22" font-size="14">Lock handoff latency (p50) vs queued waiters</text>`+"\n", left)
	// Axes, grid and labels.
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", left, height-bott, width-right, height-bott)
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", left, top, left, height-bott)
	for e := lo; e <= hi; e++ {
		v := math.Pow(10, e)
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`+"\n", left, py(v), width-right, py(v))
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%g</text>`+"\n", left-6, py(v)+4, v)
	}
	for i, n := range ns {
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%d</text>`+"\n", px(i), height-bott+18, n)
	}
	fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">queued waiters N</text>`+"\n", px(0)+(px(len(ns)-1)-px(0))/2, height-bott+40)
	fmt.Fprintf(&b, `<text x="18" y="%d" transform="rotate(-90 18 %d)" text-anchor="middle">ms (log scale)</text>`+"\n", (top+height-bott)/2, (top+height-bott)/2)
	for k, s := range ss {
		var pts []string
		for i, y := range s.ys {
			if y > 0 { // missing figures are left out
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(i), py(y)))
			}
		}
		dash := ""
		if s.label == "floor" {
			dash = ` stroke-dasharray="6 4"`
		}
		fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"%s/>`+"\n", strings.Join(pts, " "), s.color, dash)
		for i, y := range s.ys {
			if y <= 0 {
				continue
			}
			fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>`+"\n", px(i), py(y), s.color)
		}
		ly := top + 20 + 20*k
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>`+"\n", width-right+15, ly, width-right+40, ly, s.color, dash)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", width-right+46, ly+4, s.label)
	}
	fmt.Fprintf(&b, "</svg>\n")
	return b.String()
}
