package etcdsync

// Inspection: who holds a name and who waits, read once and decided by the
// rules the waiters themselves follow (internal/queue/rule.go), for every primitive that
// may live on the name.

import (
	"context"
	"fmt"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// Entry is one key of a name's queues.
type Entry struct {
	Key   string
	Rev   int64            // the key's create revision: a holder's fencing token
	Lease clientv3.LeaseID // clientv3.NoLease for a key without one
	Value []byte
	Held  bool
	// Kind is the queue the key is in: "exclusive" (NAME/<id>: a Mutex or an
	// Election, also etcdctl lock and elect), "semaphore" (NAME/<id> when
	// every value there is a semaphore's <permits>/<capacity>, with one
	// capacity), "read" or "write" (an RWMutex's NAME/read/<id>,
	// NAME/write/<id>); "member" for a Group's member (GroupMembers,
	// GroupView), whose Held is always true.
	Kind string
}

// Holders returns the keys of name's queues in queue order (create
// revision), first the direct children NAME/<id>, then an RWMutex's
// readers and writers; in each queue the holders come first. Keys of nested
// names (NAME/x/...) are not listed. It needs no Session: it blocks for one
// linearizable read through cli's KV, bounded by ctx. An invalid name is an
// error wrapping ErrInvalidName.
func Holders(ctx context.Context, cli *clientv3.Client, name string) ([]Entry, error) {
	if cli == nil {
		return nil, fmt.Errorf("%w: nil client", ErrInvalidArgument)
	}
	if err := queue.ClosedClient(cli); err != nil {
		return nil, err
	}
	if err := queue.CheckName(name); err != nil {
		return nil, err
	}
	prefix := name + "/"
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	if err != nil {
		return nil, fmt.Errorf("etcdsync: read %s: %w", prefix, err)
	}
	var direct, rw []*mvccpb.KeyValue
	for _, kv := range resp.Kvs {
		switch {
		case queue.Exclusive.Blocks(prefix, kv):
			direct = append(direct, kv)
		case queue.WriteRule.Blocks(prefix, kv):
			rw = append(rw, kv)
		}
	}
	var out []Entry
	add := func(kvs []*mvccpb.KeyValue, kind func(*mvccpb.KeyValue) (string, *queue.Rule)) error {
		for _, kv := range kvs {
			k, r := kind(kv)
			held, err := r.Holds(prefix, kvs, kv.CreateRevision)
			if err != nil {
				return err
			}
			out = append(out, Entry{Key: string(kv.Key), Rev: kv.CreateRevision, Lease: clientv3.LeaseID(kv.Lease), Value: kv.Value, Held: held, Kind: k})
		}
		return nil
	}
	directKind := func(*mvccpb.KeyValue) (string, *queue.Rule) { return "exclusive", &queue.Exclusive }
	if capacity, ok := semaphoreCapacity(direct); ok {
		directKind = func(kv *mvccpb.KeyValue) (string, *queue.Rule) {
			n, _, _ := queue.SemaphoreValue(kv.Value)
			return "semaphore", queue.Permits(capacity, n)
		}
	}
	rwKind := func(kv *mvccpb.KeyValue) (string, *queue.Rule) {
		if queue.ReadRule.In(prefix, kv) {
			return "read", &queue.ReadRule
		}
		return "write", &queue.WriteRule
	}
	if err := add(direct, directKind); err != nil {
		return nil, err
	}
	if err := add(rw, rwKind); err != nil {
		return nil, err
	}
	return out, nil
}

// semaphoreCapacity returns the capacity of the semaphore whose keys kvs
// are: every value a semaphore's, all with one capacity.
func semaphoreCapacity(kvs []*mvccpb.KeyValue) (int64, bool) {
	capacity := int64(0)
	for _, kv := range kvs {
		_, c, ok := queue.SemaphoreValue(kv.Value)
		if !ok || capacity != 0 && c != capacity {
			return 0, false
		}
		capacity = c
	}
	return capacity, capacity != 0
}
