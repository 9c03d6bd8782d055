package queue

// The blocking rules (type Rule): which keys created before ours block us,
// what each weighs, how much blocking weight may remain ahead when we hold,
// and which of the keys ahead a waiter watches; one rule per primitive
// (Exclusive for a Mutex or an Election, ReadRule and WriteRule for an
// RWMutex, Permits for a Semaphore, none for a Group's member): the
// machinery is shared.

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// Rule says whom a contender waits for: which of the keys under its prefix
// created before its own block it, their weights, and how much blocking
// weight may remain ahead when it holds. A rule without blocks is one that
// no key blocks (a Group's member).
type Rule struct {
	dir    string // our key's directory under the prefix: "" (NAME/<hex>), "read/", "write/"
	blocks func(prefix string, kv *mvccpb.KeyValue) bool
	weigh  func(kv *mvccpb.KeyValue) (int64, error) // a blocking key's weight (its value is read); nil: 1 each, keys only
	room   int64                                    // blocking weight that may remain ahead
	free   string                                   // under the prefix: what must be empty for a try to write at once
	shared bool                                     // holds of one session share the key (counted)
	// peers: keys under dir do not block each other (readers), so a
	// waiter counts those between the nearest key that blocks it and its
	// own (place.peers), and is at the front only behind one blocking key.
	peers bool
	// newest: every direct child blocks with weight 1 and none may remain,
	// so the newest few keys up to ours tell a waiter all it watches:
	// lists are limited to those (listLimit), not the whole queue.
	newest bool
	// waits reports whether kv, a key ahead of ours behind the keys of
	// run, cannot hold while those stay (place.wakesFirst); nil when keys
	// that block us block each other one at a time (a Mutex's, the
	// writers ahead of a reader), so that they go oldest first. Under the
	// others, keys ahead may hold together (readers ahead of a writer, a
	// Semaphore's holders) and go in any order.
	waits func(prefix string, run []*mvccpb.KeyValue, kv *mvccpb.KeyValue) bool
}

// Exclusive is the rule of a Mutex or an Election: every direct child of the
// prefix created before ours blocks, and none may remain.
var Exclusive = Rule{blocks: func(prefix string, kv *mvccpb.KeyValue) bool { return IsChild(prefix, string(kv.Key)) }, newest: true}

// Unqueued is the rule of a key that waits for nobody, in directory dir
// under the prefix ("" for NAME/<hex>): a Group's member, a DoubleBarrier's
// party.
func Unqueued(dir string) Rule { return Rule{dir: dir} }

// Unshared returns r for holds that the session's values do not share (a
// MultiLock's read side under ReadRule).
func (r Rule) Unshared() Rule {
	r.shared = false
	return r
}

// Blocks reports whether kv, a key under prefix created before ours, blocks
// a key under r.
func (r *Rule) Blocks(prefix string, kv *mvccpb.KeyValue) bool {
	return r.blocks != nil && r.blocks(prefix, kv)
}

// In reports whether kv is a direct child of r's directory under prefix: a
// key placed under r.
func (r *Rule) In(prefix string, kv *mvccpb.KeyValue) bool { return inDirs(r.dir)(prefix, kv) }

// blocking is Slot.blocking for a key under prefix.
func (r *Rule) blocking(prefix string, kvs []*mvccpb.KeyValue, rev int64) ([]*mvccpb.KeyValue, error) {
	if r.blocks == nil {
		return nil, nil
	}
	var out []*mvccpb.KeyValue
	for _, kv := range kvs {
		if kv.CreateRevision < rev && r.blocks(prefix, kv) {
			if r.weigh != nil {
				if _, err := r.weigh(kv); err != nil {
					return nil, err
				}
			}
			out = append(out, kv)
		}
	}
	return out, nil
}

// Holds reports whether a key created at rev under prefix holds under r,
// given the keys of kvs: the weight of those that block it leaves it room.
func (r *Rule) Holds(prefix string, kvs []*mvccpb.KeyValue, rev int64) (bool, error) {
	ahead, err := r.blocking(prefix, kvs, rev)
	return err == nil && r.weight(ahead) <= r.room, err
}

// weight is the total weight of kvs, blocking keys that blocking accepted.
// It saturates at math.MaxInt64.
func (r *Rule) weight(kvs []*mvccpb.KeyValue) int64 {
	if r.weigh == nil {
		return int64(len(kvs))
	}
	var w int64
	for _, kv := range kvs {
		n, _ := r.weigh(kv)
		w = addWeights(w, n)
	}
	return w
}

// addWeights adds two weights (≥ 0), saturating at math.MaxInt64.
func addWeights(a, b int64) int64 {
	if b > math.MaxInt64-a {
		return math.MaxInt64
	}
	return a + b
}

// ReadRule: a reader waits for the writers created before it, and its key
// is shared by the session's read holds; TryRLock writes at once when no
// writer key exists. Readers do not block each other, so only the first
// two behind a writer, when that writer is all that blocks them, watch the
// whole prefix (place.front); the others watch their nearest writer, and
// read once when it goes.
var ReadRule = Rule{dir: "read/", blocks: inDirs("write/"), free: "write/", shared: true, peers: true}

// WriteRule: a writer waits for every reader and writer created before it.
// Of the keys ahead, a writer waits behind any, a reader behind a writer.
var WriteRule = Rule{dir: "write/", blocks: inDirs("read/", "write/"), waits: func(prefix string, run []*mvccpb.KeyValue, kv *mvccpb.KeyValue) bool {
	writer := func(kv *mvccpb.KeyValue) bool { return inDirs("write/")(prefix, kv) }
	return writer(kv) || slices.ContainsFunc(run, writer)
}}

// inDirs returns a blocks rule: the key is a direct child NAME/<dir><id> of
// one of dirs, id in hex or decimal (etcd's recipes name keys by time).
func inDirs(dirs ...string) func(prefix string, kv *mvccpb.KeyValue) bool {
	return func(prefix string, kv *mvccpb.KeyValue) bool {
		rest, ok := strings.CutPrefix(string(kv.Key), prefix)
		if !ok {
			return false
		}
		for _, d := range dirs {
			if IsChild(d, rest) {
				return true
			}
		}
		return false
	}
}

// Permits is the rule of a request for n of capacity permits: every direct
// child of the prefix created before ours blocks with its permits, and
// capacity-n of them may remain. A key ahead waits behind keys whose
// permits leave it no room.
func Permits(capacity, n int64) *Rule {
	r := &Rule{
		blocks: Exclusive.blocks,
		room:   capacity - n,
		weigh: func(kv *mvccpb.KeyValue) (int64, error) {
			weight, cp, ok := SemaphoreValue(kv.Value)
			switch {
			case !ok:
				return 0, fmt.Errorf("%w: key %s has value %q, not a semaphore's <permits>/<capacity>", ErrInvalidArgument, kv.Key, kv.Value)
			case cp != capacity:
				return 0, fmt.Errorf("%w: key %s holds or waits for %d of %d permits, and this semaphore's capacity is %d", ErrInvalidArgument, kv.Key, weight, cp, capacity)
			}
			return weight, nil
		},
	}
	r.waits = func(_ string, run []*mvccpb.KeyValue, kv *mvccpb.KeyValue) bool {
		return addWeights(r.weight(run), r.weight([]*mvccpb.KeyValue{kv})) > capacity
	}
	return r
}

// SemaphoreValue parses a semaphore key's value, "<permits>/<capacity>",
// with 1 <= permits <= capacity.
func SemaphoreValue(v []byte) (permits, capacity int64, ok bool) {
	w, c, cut := strings.Cut(string(v), "/")
	permits, err1 := strconv.ParseInt(w, 10, 64)
	capacity, err2 := strconv.ParseInt(c, 10, 64)
	return permits, capacity, cut && err1 == nil && err2 == nil && permits >= 1 && permits <= capacity
}
