package etcdsync

// The blocking rules: which keys created before ours block us, what each
// weighs, how much blocking weight may remain ahead when we hold, and which
// of the keys ahead a waiter watches. A primitive is a rule (mutex.go,
// rwmutex.go, semaphore.go, election.go, group.go); the machinery is shared.

import (
	"math"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// rule says whom a contender waits for: which of the keys under its prefix
// created before its own block it, their weights, and how much blocking
// weight may remain ahead when it holds. A rule without blocks is one that
// no key blocks (a Group's member).
type rule struct {
	dir    string // our key's directory under the prefix: "" (NAME/<hex>), "read/", "write/"
	blocks func(prefix string, kv *mvccpb.KeyValue) bool
	weigh  func(kv *mvccpb.KeyValue) (int64, error) // a blocking key's weight (its value is read); nil: 1 each, keys only
	room   int64                                    // blocking weight that may remain ahead
	free   string                                   // under the prefix: what must be empty for a try to write at once
	shared bool                                     // holds of one session share the key (counted)
	// exact: watch only the keys that keep us out, not also the one behind
	// them, so that a release reaches only waiters it may let in; a waiter
	// whose nearest key goes while older ones were listed then reads once.
	exact bool
	// newest: every direct child blocks with weight 1 and none may remain,
	// so the newest few keys up to ours tell a waiter all it watches:
	// lists are limited to those (listLimit), not the whole queue.
	newest bool
}

// exclusive is the rule of a Mutex or an Election: every direct child of the
// prefix created before ours blocks, and none may remain.
var exclusive = rule{blocks: func(prefix string, kv *mvccpb.KeyValue) bool { return isChild(prefix, string(kv.Key)) }, newest: true}

// blocking is slot.blocking for a key under prefix.
func (r *rule) blocking(prefix string, kvs []*mvccpb.KeyValue, rev int64) ([]*mvccpb.KeyValue, error) {
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

// holds reports whether a key created at rev under prefix holds under r,
// given the keys of kvs: the weight of those that block it leaves it room.
func (r *rule) holds(prefix string, kvs []*mvccpb.KeyValue, rev int64) (bool, error) {
	ahead, err := r.blocking(prefix, kvs, rev)
	return err == nil && r.weight(ahead) <= r.room, err
}

// weight is the total weight of kvs, blocking keys that blocking accepted.
// It saturates at math.MaxInt64.
func (r *rule) weight(kvs []*mvccpb.KeyValue) int64 {
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
