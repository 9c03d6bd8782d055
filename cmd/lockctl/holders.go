//go:build unix

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// newHoldersCmd is "lockctl holders".
func newHoldersCmd(conn *connFlags) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "holders [flags] NAME",
		Short: "List who holds NAME and who waits, in queue order",
		Long: `List the holders and waiters of NAME in queue order (create revision), with
each key's create revision, lease, the lease's TTL left in seconds (-1 when
it is gone) and value. It reads the keys once and each distinct lease once,
each read bounded by --dial-timeout.

Two queues can live on one name, each numbered from 1:
  exclusive  NAME/<id>: a Mutex or an Election (also etcdctl lock/elect);
             the oldest holds, the others wait
  semaphore  NAME/<id> whose values are all "<permits>/<capacity>": holders
             in order while their permits fit in the capacity
  read/write NAME/read/<id>, NAME/write/<id>: an RWMutex; a reader holds
             when no writer is older, a writer when it is the oldest
Keys of nested names (NAME/x/...) are not listed. A name nobody holds or
waits for prints the header only (table) or [] (json).`,
		Example: `  lockctl holders nightly-report
  lockctl holders -o json downloads | jq '.[] | select(.role == "waiter") | .key'`,
		Args: cobra.ArbitraryArgs,
		RunE: withCode(func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return usage(fmt.Errorf("want NAME, got %d argument(s) (see '%s --help')", len(args), cmd.CommandPath()))
			}
			if output != "table" && output != "json" {
				return usage(fmt.Errorf("-o %q: want table or json", output))
			}
			if err := checkName(args[0]); err != nil {
				return err
			}
			return holders(conn, args[0], output, cmd.OutOrStdout())
		}),
	}
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table or json")
	return cmd
}

// entry is one key of a name's queues.
type entry struct {
	Position       int    `json:"position"` // in its queue, from 1
	Role           string `json:"role"`     // holder or waiter
	Kind           string `json:"kind"`     // exclusive, semaphore, read or write
	Key            string `json:"key"`
	CreateRevision int64  `json:"create_revision"`
	Lease          string `json:"lease"` // hex, "" for a key without a lease
	TTL            int64  `json:"ttl"`   // seconds left; -1 when the lease is gone or there is none
	Value          string `json:"value"`

	leaseID int64
}

// holders prints name's queues to out. It blocks for one read of the keys
// and one per distinct lease, each bounded by --dial-timeout.
func holders(cf *connFlags, name, output string, out io.Writer) error {
	prefix := name + "/"
	cli, err := cf.dial(context.Background(), prefix)
	if err != nil {
		return err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), cf.dialTimeout)
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	cancel()
	if err != nil {
		return fmt.Errorf("read %s: %w", prefix, err)
	}
	entries := queues(prefix, resp.Kvs)
	ttls := map[int64]int64{0: -1}
	for i, e := range entries {
		lease := e.leaseID
		if _, ok := ttls[lease]; !ok {
			ctx, cancel := context.WithTimeout(context.Background(), cf.dialTimeout)
			ttl, err := cli.TimeToLive(ctx, clientv3.LeaseID(lease))
			cancel()
			if err != nil {
				return fmt.Errorf("read lease %x: %w", lease, err)
			}
			ttls[lease] = ttl.TTL
		}
		entries[i].TTL = ttls[lease]
	}
	if output == "json" {
		if entries == nil {
			entries = []entry{}
		}
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(entries)
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "POS\tROLE\tKIND\tKEY\tREV\tLEASE\tTTL\tVALUE")
	for _, e := range entries {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%d\t%s\n", e.Position, e.Role, e.Kind, e.Key, e.CreateRevision, e.Lease, e.TTL, strconv.Quote(e.Value))
	}
	return tw.Flush()
}

// queues sorts kvs (in create-revision order) into the name's queues and
// tells holders from waiters by etcdsync's rules: first the direct children
// NAME/<id> (a semaphore's when every value is one, else exclusive), then
// the RWMutex's NAME/read/<id> and NAME/write/<id>. Other keys are left out.
func queues(prefix string, kvs []*mvccpb.KeyValue) []entry {
	var direct, rw []*mvccpb.KeyValue
	for _, kv := range kvs {
		rest, _ := strings.CutPrefix(string(kv.Key), prefix)
		switch {
		case isID(rest):
			direct = append(direct, kv)
		case isIn(rest, "read/"), isIn(rest, "write/"):
			rw = append(rw, kv)
		}
	}
	var entries []entry
	if weights, capacity, ok := semaphore(direct); ok {
		used, full := int64(0), false
		for i, kv := range direct {
			holds := !full && used+weights[i] <= capacity
			if holds {
				used += weights[i]
			} else {
				full = true // FIFO: nobody passes a waiter
			}
			entries = append(entries, newEntry(i, holds, "semaphore", kv))
		}
	} else {
		for i, kv := range direct {
			entries = append(entries, newEntry(i, i == 0, "exclusive", kv))
		}
	}
	writerAhead := false
	for i, kv := range rw {
		rest, _ := strings.CutPrefix(string(kv.Key), prefix)
		if isIn(rest, "write/") {
			entries = append(entries, newEntry(i, i == 0, "write", kv))
			writerAhead = true
		} else {
			entries = append(entries, newEntry(i, !writerAhead, "read", kv))
		}
	}
	return entries
}

// newEntry is the row of kv at index i of its queue.
func newEntry(i int, holds bool, kind string, kv *mvccpb.KeyValue) entry {
	e := entry{Position: i + 1, Role: "waiter", Kind: kind, Key: string(kv.Key), CreateRevision: kv.CreateRevision, Value: string(kv.Value), TTL: -1}
	if holds {
		e.Role = "holder"
	}
	if kv.Lease != 0 {
		e.Lease, e.leaseID = strconv.FormatInt(kv.Lease, 16), kv.Lease
	}
	return e
}

// semaphore returns each key's permits and the capacity when every value
// is a semaphore's "<permits>/<capacity>" with one capacity.
func semaphore(kvs []*mvccpb.KeyValue) (weights []int64, capacity int64, ok bool) {
	for _, kv := range kvs {
		w, c, found := strings.Cut(string(kv.Value), "/")
		weight, err1 := strconv.ParseInt(w, 10, 64)
		cp, err2 := strconv.ParseInt(c, 10, 64)
		if !found || err1 != nil || err2 != nil || weight < 1 || weight > cp || capacity != 0 && cp != capacity {
			return nil, 0, false
		}
		weights, capacity = append(weights, weight), cp
	}
	return weights, capacity, len(kvs) > 0
}

// isID reports whether s is a key's last part as etcdsync and etcd write
// it: a lease ID in hex (or a number), nothing else.
func isID(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// isIn reports whether s is dir followed by an ID.
func isIn(s, dir string) bool {
	rest, ok := strings.CutPrefix(s, dir)
	return ok && isID(rest)
}
