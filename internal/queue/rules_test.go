package queue

// The blocking rules, weights, the front of a queue, the keys a waiter watches and name
// validation, without a server: each case is a queue of keys as etcd lists
// them (sorted by create revision).

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// queue makes keys under prefix "n/", created at revisions 1, 2, ... in
// order; "k=v" gives key n/k the value v.
func queue(keys ...string) []*mvccpb.KeyValue {
	var out []*mvccpb.KeyValue
	for i, k := range keys {
		k, v, _ := strings.Cut(k, "=")
		out = append(out, &mvccpb.KeyValue{Key: []byte("n/" + k), Value: []byte(v), CreateRevision: int64(i + 1)})
	}
	return out
}

func keyNames(kvs []*mvccpb.KeyValue) []string {
	var out []string
	for _, kv := range kvs {
		out = append(out, strings.TrimPrefix(string(kv.Key), "n/"))
	}
	return out
}

func TestRulesWhichKeysBlock(t *testing.T) {
	kvs := queue("1a", "x/2b", "read/3c", "write/4d", "5e", "read/6f", "write/7a", "8b")
	for _, c := range []struct {
		name string
		r    *Rule
		rev  int64 // our key's create revision
		want []string
	}{
		{"a mutex waits for every direct child before it, not nested or other keys", &Exclusive, 9, []string{"1a", "5e", "8b"}},
		{"a mutex's first key has nothing ahead", &Exclusive, 1, nil},
		{"a reader waits for the writers before it only", &ReadRule, 7, []string{"write/4d"}},
		{"a writer waits for every reader and writer before it", &WriteRule, 7, []string{"read/3c", "write/4d", "read/6f"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := c.r.blocking("n/", kvs, c.rev)
			if err != nil {
				t.Fatal(err)
			}
			if g := keyNames(got); !slices.Equal(g, c.want) {
				t.Fatalf("blocking = %v, want %v", g, c.want)
			}
		})
	}
}

func TestRulesSemaphoreWeights(t *testing.T) {
	kvs := queue("1a=2/4", "2b=1/4", "3c=3/4", "4d=1/4")
	for _, c := range []struct {
		n    int64 // our request
		rev  int64
		want bool // holds
	}{
		{2, 1, true},  // nothing ahead
		{1, 2, true},  // 2 ahead, room 3
		{3, 3, false}, // 3 ahead, room 1
		{1, 4, false}, // FIFO: 6 ahead (the waiter's 3 count), room 3
		{2, 2, true},  // 2 ahead, room 2
	} {
		got, err := Permits(4, c.n).Holds("n/", kvs, c.rev)
		if err != nil || got != c.want {
			t.Errorf("%d permits at rev %d: holds = %v, %v; want %v", c.n, c.rev, got, err, c.want)
		}
	}
	bad := queue("1a=2/4", "2b=oops")
	if _, err := Permits(4, 1).blocking("n/", bad, 3); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("a key that is not a semaphore's: %v, want ErrInvalidArgument", err)
	}
	other := queue("1a=2/5")
	if _, err := Permits(4, 1).blocking("n/", other, 2); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("a key of another capacity: %v, want ErrInvalidArgument", err)
	}
}

func TestRulesWeightsSaturate(t *testing.T) {
	if got := addWeights(math.MaxInt64-1, 5); got != math.MaxInt64 {
		t.Fatalf("addWeights saturates: %d", got)
	}
	if got := addWeights(2, 3); got != 5 {
		t.Fatalf("addWeights(2, 3) = %d", got)
	}
}

// Only the first waiters of a queue watch the whole prefix: two behind the
// keys that hold; for readers the first two behind a writer, when that
// writer is all that blocks them.
func TestRulesFrontIsTheFirstTwo(t *testing.T) {
	for _, c := range []struct {
		name  string
		r     *Rule
		ahead []string
		peers int
		farN  int
		want  bool
	}{
		{"a mutex's first waiter", &Exclusive, []string{"1a"}, 0, 0, true},
		{"a mutex's second waiter", &Exclusive, []string{"1a", "2b"}, 0, 0, true},
		{"a mutex's third waiter", &Exclusive, []string{"1a", "2b", "3c"}, 0, 0, false},
		{"a waiter with keys ahead it does not keep", &Exclusive, []string{"1a"}, 0, 1, false},
		{"a reader second behind a writer", &ReadRule, []string{"write/1a"}, 1, 0, true},
		{"a reader third behind a writer", &ReadRule, []string{"write/1a"}, 2, 0, false},
		{"a reader whose nearest writer went unread", &ReadRule, []string{"write/1a"}, unknownPeers, 0, false},
		{"a reader behind two writers", &ReadRule, []string{"write/1a", "write/2b"}, 0, 0, false},
		{"a semaphore's second waiter behind a full capacity", Permits(4, 1), []string{"1a=1/4", "2b=1/4", "3c=1/4", "4d=1/4", "5e=1/4"}, 0, 0, true},
		{"a semaphore's third waiter", Permits(4, 1), []string{"1a=1/4", "2b=1/4", "3c=1/4", "4d=1/4", "5e=1/4", "6f=1/4"}, 0, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			tn := &place{Slot: &Slot{prefix: "n/", rule: c.r}, ahead: queue(c.ahead...), peers: c.peers, farN: c.farN}
			if got := tn.front(); got != c.want {
				t.Fatalf("front = %v, want %v", got, c.want)
			}
		})
	}
}

// A reader whose nearest writer goes counts the readers listed between the
// two nearest writers as its own peers: the first reader behind a writer
// that gives up is at the front behind the older one when no reader lies
// between them. Once the next writer goes too, it does not know.
func TestRulesReaderBehindAWriterThatWent(t *testing.T) {
	two, three := []string{"write/1a", "write/2b"}, []string{"write/1a", "write/2b", "write/3c"}
	for _, c := range []struct {
		name             string
		ahead            []string
		peers, peersNext int
		drop             []int
		want             bool
	}{
		{"no reader between the writers", two, 0, 0, []int{1}, true},
		{"one reader between them, and one behind", two, 1, 0, []int{1}, true},
		{"two readers between them", two, 0, 2, []int{1}, false},
		{"the two nearest went", three, 0, 0, []int{2, 1}, false},
		{"the next one went, then the nearest", three, 0, 0, []int{1, 1}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			tn := &place{Slot: &Slot{prefix: "n/", rule: &ReadRule}, ahead: queue(c.ahead...), peers: c.peers, peersNext: c.peersNext}
			for _, i := range c.drop {
				tn.drop(i)
			}
			if got := tn.front(); got != c.want {
				t.Fatalf("front = %v (peers %d), want %v", got, tn.peers, c.want)
			}
		})
	}
}

// A waiter away from the front watches a run of keys whose weight exceeds
// its room, past the nearest two when it can: it wakes when it may have
// come to the front, and no earlier. Where keys ahead hold together and go
// in any order (readers ahead of a writer, a Semaphore's holders), the run
// takes in keys behind it until it still blocks without any one of its
// keys, counting the keys behind it that wait for it: the turn never comes
// on the first delete it hears.
func TestRulesKeysWatched(t *testing.T) {
	for _, c := range []struct {
		name  string
		r     *Rule
		ahead []string
		want  []string
	}{
		{"a mutex's waiter watches the third key ahead", &Exclusive, []string{"1a", "2b", "3c", "4d"}, []string{"2b"}},
		{"with one key ahead, that key", &Exclusive, []string{"1a"}, []string{"1a"}},
		{"a reader among many behind two writers watches the nearest", &ReadRule, []string{"write/1a", "write/2b"}, []string{"write/2b"}},
		{"a reader behind four writers watches the third", &ReadRule, []string{"write/1a", "write/2b", "write/3c", "write/4d"}, []string{"write/2b"}},
		{"a semaphore watches a run past the nearest two whose weight exceeds the room", Permits(4, 2), []string{"1a=1/4", "2b=2/4", "3c=2/4", "4d=1/4"}, []string{"1a=1/4", "2b=2/4"}},
		{"past the nearest two that may hold with it, one more", Permits(4, 2), []string{"1a=1/4", "2b=2/4", "3c=1/4", "4d=1/4"}, []string{"1a=1/4", "2b=2/4", "3c=1/4"}},
		{"behind a full capacity", Permits(4, 1), []string{"1a=1/4", "2b=1/4", "3c=1/4", "4d=1/4", "5e=1/4", "6f=1/4"}, []string{"1a=1/4", "2b=1/4", "3c=1/4", "4d=1/4"}},
		{"when those past the nearest two leave room, the nearest run", Permits(4, 2), []string{"1a=1/4", "2b=2/4", "3c=1/4"}, []string{"2b=2/4", "3c=1/4"}},
		{"a large request behind holders watches two", Permits(4, 4), []string{"1a=1/4", "2b=1/4", "3c=1/4"}, []string{"1a=1/4", "2b=1/4"}},
		{"a large request behind waiters watches one", Permits(4, 4), []string{"1a=4/4", "2b=1/4", "3c=1/4"}, []string{"1a=4/4"}},
		{"a writer behind three readers watches two", &WriteRule, []string{"read/1a", "read/2b", "read/3c"}, []string{"read/1a", "read/2b"}},
		{"a writer behind readers that wait for a writer watches that writer", &WriteRule, []string{"read/1a", "write/2b", "read/3c", "read/4d"}, []string{"write/2b"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			tn := &place{Slot: &Slot{prefix: "n/", rule: c.r}, ahead: queue(c.ahead...)}
			if got, want := keyNames(tn.watched()), keyNames(queue(c.want...)); !slices.Equal(got, want) {
				t.Fatalf("watched = %v, want %v", got, want)
			}
		})
	}
}

// A waiter keeps only the nearest keys (its watched run, and a weight of
// its room and four more), and the weight and number of the others: its memory does not grow with the queue
// ahead, and it stays blocked by what it no longer keeps. At the front it
// keeps them all.
func TestRulesWaiterKeepsOnlyNearest(t *testing.T) {
	long := make([]string, 1000)
	sems := make([]string, 1000)
	for i := range long {
		long[i] = fmt.Sprintf("%x", i+1)
		sems[i] = long[i] + "=1/4"
	}
	for _, c := range []struct {
		name    string
		r       *Rule
		ahead   []string
		kept    []string
		far     int64
		blocked bool
	}{
		{"a mutex behind 1000 keeps 5", &Exclusive, long, long[995:], 995, true},
		{"a mutex's second waiter keeps both", &Exclusive, long[:2], long[:2], 0, true},
		{"a semaphore keeps a weight of its room and four more", Permits(4, 1), sems[:20], sems[12:20], 12, true},
		{"a semaphore keeps its watched run", Permits(4, 2), []string{"1a=1/4", "2b=2/4", "3c=1/4", "4d=1/4", "5e=1/4"}, []string{"1a=1/4", "2b=2/4", "3c=1/4", "4d=1/4", "5e=1/4"}, 0, true},
		{"room left over the far keys", Permits(4, 1), []string{"1a=1/4", "2b=1/4"}, []string{"1a=1/4", "2b=1/4"}, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			tn := &place{Slot: &Slot{prefix: "n/", rule: c.r}, ahead: queue(c.ahead...)}
			tn.keepNearest()
			if got, want := keyNames(tn.ahead), keyNames(queue(c.kept...)); !slices.Equal(got, want) {
				t.Fatalf("kept %v, want %v", got, want)
			}
			if tn.far != c.far || tn.farN != len(c.ahead)-len(c.kept) || tn.blocked() != c.blocked {
				t.Fatalf("far %d (%d keys), blocked %v; want %d (%d keys), %v", tn.far, tn.farN, tn.blocked(), c.far, len(c.ahead)-len(c.kept), c.blocked)
			}
			tn.keepNearest() // again: nothing changes
			if got := len(tn.ahead); got != len(c.kept) || tn.far != c.far {
				t.Fatalf("a second keepNearest kept %d keys, far %d", got, tn.far)
			}
		})
	}
}

func TestNamesChecked(t *testing.T) {
	for name, ok := range map[string]bool{"jobs/nightly": true, "/a/b": true, "x": true, "": false, "a\x00b": false} {
		if err := CheckName(name); (err == nil) != ok || err != nil && !errors.Is(err, ErrInvalidName) {
			t.Errorf("checkName(%q) = %v", name, err)
		}
	}
	for key, ok := range map[string]bool{"n/1a": true, "n/0": true, "n/": false, "n/x": false, "n/1a/2b": false, "m/1a": false, "n/1A": false} {
		if got := IsChild("n/", key); got != ok {
			t.Errorf("isChild(n/, %q) = %v", key, got)
		}
	}
	for v, ok := range map[string]bool{"1/4": true, "4/4": true, "0/4": false, "5/4": false, "x/4": false, "1": false, "": false} {
		if _, _, got := SemaphoreValue([]byte(v)); got != ok {
			t.Errorf("semaphoreValue(%q) ok = %v", v, got)
		}
	}
}
